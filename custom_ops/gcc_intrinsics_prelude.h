// Included ahead of every C++ source of the custom ops by gpt2forge/ops/build.py (-include), so that
// it is the first inclusion of the intrinsics headers.
//
// GCC 12.1-12.2 warns that its own AVX-512 intrinsics read an uninitialized vector (the deliberately
// undefined _mm256_undefined_pd and kin) wherever one is inlined into a kernel, -isystem
// notwithstanding (GCC bug 105593): pages of warnings about the compiler's headers. These two
// warnings are turned off for the lines of those headers only; a warning located in our sources
// still shows. Diagnostics only: the generated code is the same.
#pragma once
#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__i386__))
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif
