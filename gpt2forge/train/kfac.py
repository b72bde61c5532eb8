"""K-FAC: a Kronecker-factored preconditioner of the blocks' `nn.Linear` gradients (`--kfac`), after
kfac-pytorch (Pauloski et al., KAISA) and Martens & Grosse (2015).

Fisher definition. For a Linear layer y = W a + b, every row r of a micro-batch (a token position:
the B x T rows are flattened, kfac-pytorch's "expand" convention) gives ā_r = [a_r, 1] (the bias
column last) and δ_r = d(sum of the update's token losses)/dy_r. Then, averaged over every row of
the update (all micro-batches, all replicas),
    A = mean_r ā_r ā_r^T    (in+1, in+1)        G = mean_r δ_r δ_r^T    (out, out)
and the layer's Fisher block is approximated by A ⊗ G. δ is the gradient of the *summed* loss, i.e.
the hook's grad_output divided by the step's loss scale (fp16 scale x replicas / global tokens): so
G does not depend on the batch size, the loss scale or the replica count, as kfac-pytorch's older
`batch_averaged` convention (its newer layers keep grad_output of the mean loss, a factor tokens^2
smaller, which moves what a given damping means). Factors are fp32 whatever the compute precision.

Running average (kfac-pytorch): the first factor starts at I, then F = decay F + (1 - decay) F_new
every --kfac-factor-update-steps updates. Every --kfac-inv-update-steps updates the factors are
decomposed, and every update the gradient ∇ = [∇W, ∇b] (out, in+1) is replaced by
- eigen (default): A = QA diag(dA) QA^T, G = QG diag(dG) QG^T (eigenvalues clamped at 0),
  V = QG [(QG^T ∇ QA) / (dG dA^T + λ)] QA^T, i.e. (A ⊗ G + λ I)^-1 ∇: G V A + λ V = ∇;
- inverse: V = (G + λ I)^-1 ∇ (A + λ I)^-1 (λ added to each factor, as kfac-pytorch).
KL clipping (kfac-pytorch): every V is scaled by min(1, sqrt(kl_clip / |lr^2 sum_layers <V, ∇>|)).

Where it runs: train_step captures the factors during the update's forward/backward (hooks are on
only in a factor-update update), and calls `step(lr)` after the fp16 unscale and before clipping, so
--max-grad-norm bounds the preconditioned update. Hooks: a forward hook takes the input's statistics
(a^T a, sum a, rows) at once and registers a hook on the output tensor that adds them with δ δ^T
when the gradient arrives; so a forward recomputed by activation checkpointing (whose outputs get
no gradient) counts nothing twice, and an update whose gradients are not finite folds nothing.

Data parallelism: KAISA's COMM-OPT (grad_worker_fraction 1). The factors' sums are all-reduced at
a factor update (every replica then holds the same A and G); each factor's decomposition is
computed by one rank (greedy by n^3 cost) and broadcast, and every rank preconditions every
gradient itself, so no gradient is broadcast. It keeps communication at one broadcast per factor
per decomposition (MEM-OPT would broadcast every preconditioned gradient every update) and spreads
the O(n^3) work over the ranks, at the memory of one decomposition per factor on every rank.
Pipeline stages, tensor parallelism and FSDP2 (ZeRO-2/3, --offload full) are refused: their
gradients are sharded or split across processes.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from gpt2forge.core import log
from gpt2forge.core.errors import UsageError
from gpt2forge.parallel.strategy import Strategy
from gpt2forge.train.config import KfacArgs

DEFAULT_SKIP = ("wte", "wpe", "lm_head")
"""--kfac-skip-layers' default: the embeddings and the LM head (tied to wte)."""

GRAM_BLOCK = 768
"""Width of the column blocks `gram` multiplies; a factor at least twice as wide is computed by blocks."""


def gram(x: torch.Tensor) -> torch.Tensor:
    """x.T @ x for x (rows, n). From n >= 2 GRAM_BLOCK only the blocks on and above
    the diagonal are multiplied and the rest mirrored: 10 of 16 block products at n = 3072 (the MLP's
    factors), 6 of 9 at 2304 (c_attn's G): faster than one full product at both widths on the
    2-core machine (measured: docs/benchmarks.md, Design measurements)."""
    n = x.shape[1]
    if n < 2 * GRAM_BLOCK:
        return x.T @ x
    out = x.new_empty(n, n)
    edges = [*range(0, n, GRAM_BLOCK), n]
    for i, (lo, hi) in enumerate(zip(edges, edges[1:])):
        for lo2, hi2 in zip(edges[i:], edges[i + 1:]):
            block = x[:, lo:hi].T @ x[:, lo2:hi2]
            out[lo:hi, lo2:hi2] = block
            if lo2 != lo:
                out[lo2:hi2, lo:hi] = block.T
    return out


class KfacLayer:
    """One preconditioned nn.Linear: its pending sums, running factors and decomposition."""

    def __init__(self, name: str, module: nn.Linear):
        self.name, self.module = name, module
        self.bias = module.bias is not None
        n_in, n_out = module.in_features + self.bias, module.out_features
        device = module.weight.device
        self.a_sum = torch.zeros(n_in, n_in, device=device)  # sum ā ā^T over the update's rows
        self.g_sum = torch.zeros(n_out, n_out, device=device)  # sum δ δ^T
        self.rows = torch.zeros((), device=device)
        self.A: torch.Tensor | None = None  # running averages
        self.G: torch.Tensor | None = None
        self.decomposed: dict[str, torch.Tensor] = {}  # eigen: QA dA QG dG; inverse: A_inv G_inv
        self.eigen_scale: torch.Tensor | None = None  # eigen: 1 / (dG dA^T + λ), (out, in+1), padded
        self.qa_padded: torch.Tensor | None = None  # eigen: QA padded to a multiple of 8 (see _eigen_parts)

    def add(self, aa: torch.Tensor, a_total: torch.Tensor, rows: int, gg: torch.Tensor) -> None:
        """One micro-batch's statistics: a^T a, sum of a over the rows, the row count and δ^T δ."""
        n = self.module.in_features
        self.a_sum[:n, :n] += aa
        if self.bias:  # ā = [a, 1]
            self.a_sum[:n, n] += a_total
            self.a_sum[n, :n] += a_total
            self.a_sum[n, n] += rows
        self.g_sum += gg
        self.rows += rows

    def gradient(self) -> torch.Tensor | None:
        """[∇W, ∇b] as (out, in+1) fp32 ((out, in) without bias), or None before any gradient."""
        w = self.module.weight.grad
        if w is None:
            return None
        if not self.bias:
            return w.float()
        return torch.cat([w.float(), self.module.bias.grad.float().unsqueeze(1)], dim=1)

    def set_gradient(self, v: torch.Tensor) -> None:
        n = self.module.in_features
        self.module.weight.grad.copy_(v[:, :n])
        if self.bias:
            self.module.bias.grad.copy_(v[:, n])


class KfacPreconditioner:
    """K-FAC over the nn.Linear layers of `model` not matched by `args.kfac_skip_layers`.

    Use: `with kfac.capturing(scale): forward/backward` (scale: what the summed loss was multiplied
    by), then `kfac.step(lr)` before clipping and the optimizer's step. `rank`/`world`: this
    process among the data-parallel replicas (the default process group when `world` > 1)."""

    def __init__(self, model: nn.Module, args: KfacArgs, rank: int = 0, world: int = 1):
        self.args, self.rank, self.world = args, rank, world
        patterns = [re.compile(p) for p in (args.kfac_skip_layers or DEFAULT_SKIP)]
        self.layers = [KfacLayer(name, m) for name, m in model.named_modules()
                       if isinstance(m, nn.Linear) and all(p.requires_grad for p in m.parameters())
                       and not any(p.search(name) or p.search(type(m).__name__) for p in patterns)]
        if not self.layers:
            raise UsageError("--kfac: every nn.Linear layer matches --kfac-skip-layers; nothing to precondition")
        for layer in self.layers:
            layer.module.register_forward_hook(functools.partial(self._on_forward, layer))
        self.owner = self._assign_decompositions()
        self.steps = 0  # updates seen (skipped ones too: the intervals count updates, as the LR schedule)
        self._capturing = False
        self._inv_scale: torch.Tensor | float = 1.0

    def _assign_decompositions(self) -> dict[tuple[str, str], int]:
        """(layer, "A"|"G") -> the rank that decomposes it: largest first to the least loaded rank
        (KAISA's greedy assignment, cost n^3); the same on every rank."""
        work = [(layer.a_sum.shape[0] ** 3, layer.name, "A") for layer in self.layers]
        work += [(layer.g_sum.shape[0] ** 3, layer.name, "G") for layer in self.layers]
        load = [0] * self.world
        owner = {}
        for cost, name, factor in sorted(work, key=lambda w: (-w[0], w[1], w[2])):
            rank = min(range(self.world), key=load.__getitem__)
            owner[name, factor] = rank
            load[rank] += cost
        return owner

    def describe(self) -> str:
        a = self.args
        where = f"KAISA COMM-OPT over {self.world} replicas" if self.world > 1 else "one process"
        return (f"K-FAC: {len(self.layers)} nn.Linear layers ({self.layers[0].name} ... {self.layers[-1].name}), "
                f"{a.kfac_compute_method}, factors every {a.kfac_factor_update_steps} updates, decompositions every "
                f"{a.kfac_inv_update_steps}, damping {a.kfac_damping}, decay {a.kfac_factor_decay}, "
                f"kl_clip {a.kfac_kl_clip}, {where}")

    # -- capturing the factors ---------------------------------------------------------------------
    @contextlib.contextmanager
    def capturing(self, scale: torch.Tensor | float) -> Iterator[None]:
        """Hooks on for this update's forward/backward when it is a factor update. `scale`: the
        factor the summed token loss was multiplied by before backward (δ = grad_output / scale)."""
        self._capturing = self.steps % self.args.kfac_factor_update_steps == 0
        self._inv_scale = 1.0 / scale
        try:
            yield
        finally:
            self._capturing = False

    def _on_forward(self, layer: KfacLayer, module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        if not (self._capturing and torch.is_grad_enabled() and output.requires_grad):
            return
        a = inputs[0].detach().reshape(-1, module.in_features).float()  # (rows, in)
        stats = (gram(a), a.sum(0), a.shape[0])
        output.register_hook(functools.partial(self._on_grad_output, layer, stats, self._inv_scale))

    @staticmethod
    def _on_grad_output(layer: KfacLayer, stats: tuple, inv_scale, grad: torch.Tensor) -> None:
        g = grad.detach().reshape(-1, grad.shape[-1]).float() * inv_scale  # (rows, out): δ
        layer.add(*stats, gram(g))

    # -- one update ----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, lr: float) -> None:
        """Fold the captured factors (factor update), decompose (every --kfac-inv-update-steps, or the
        first time factors exist), then precondition every layer's gradient in place."""
        a = self.args
        if self.steps % a.kfac_factor_update_steps == 0:
            self._fold_factors()
        due = self.steps % a.kfac_inv_update_steps == 0 or not self.layers[0].decomposed
        if due and self.layers[0].A is not None:
            self._decompose()
        if self.layers[0].decomposed:
            self._precondition(lr)
        self.steps += 1

    def _fold_factors(self) -> None:
        """The update's sums, all-reduced over the replicas, into the running averages; an update
        whose sums are not finite (an fp16 overflow) folds nothing."""
        sums = [t for layer in self.layers for t in (layer.a_sum, layer.g_sum, layer.rows)]
        if self.world > 1:
            for work in [dist.all_reduce(t, async_op=True) for t in sums]:
                work.wait()
        finite = bool(torch.stack([t.isfinite().all() for t in sums]).all())
        decay = self.args.kfac_factor_decay
        for layer in self.layers:
            if finite and layer.rows > 0:
                for name, total in (("A", layer.a_sum), ("G", layer.g_sum)):
                    old = getattr(layer, name)
                    old = torch.eye(total.shape[0], device=total.device) if old is None else old
                    setattr(layer, name, decay * old + (1 - decay) * (total / layer.rows))
            for t in (layer.a_sum, layer.g_sum, layer.rows):
                t.zero_()

    def _decompose(self) -> None:
        """Each factor's eigendecomposition (or damped inverse) on its owner rank, broadcast to all."""
        sends = []
        for layer in self.layers:
            for factor in ("A", "G"):
                src = self.owner[layer.name, factor]
                parts = self._decomposition(factor, getattr(layer, factor), computed=src == self.rank)
                layer.decomposed.update(parts)
                sends += [(t, src) for t in parts.values()]
        if self.world > 1:
            for work in [dist.broadcast(t, src=src, async_op=True) for t, src in sends]:
                work.wait()
        if self.args.kfac_compute_method == "eigen":
            for layer in self.layers:
                self._eigen_parts(layer)

    def _decomposition(self, factor: str, f: torch.Tensor, computed: bool) -> dict[str, torch.Tensor]:
        """`factor`'s decomposition ("QA", "dA" or "A_inv"), or buffers of its shape to receive it."""
        n = f.shape[0]
        if self.args.kfac_compute_method == "eigen":
            if not computed:
                return {"Q" + factor: f.new_empty(n, n), "d" + factor: f.new_empty(n)}
            d, q = torch.linalg.eigh(f)
            # eigh returns Q column-major; a broadcast sends the storage as it lies, so make it row-major
            # as the receivers' buffers are (else they get Q transposed).
            return {"Q" + factor: q.contiguous(), "d" + factor: d.clamp(min=0.0)}
        if not computed:
            return {factor + "_inv": f.new_empty(n, n)}
        return {factor + "_inv": torch.linalg.inv(f + self.args.kfac_damping * torch.eye(n, device=f.device))}

    def _eigen_parts(self, layer: KfacLayer) -> None:
        """The eigen preconditioning's operands: 1 / (dG dA^T + λ), and QA. in+1 columns (769 at
        GPT-2 small) make every matmul with QA markedly slower than a multiple of 8 does (measured:
        docs/benchmarks.md, Design measurements), so QA is padded to blockdiag(QA, I) and the scale
        with ones: the gradient's padding columns are zero, the preconditioned gradient's come out
        zero and are dropped, the rest is unchanged."""
        d = layer.decomposed
        n = d["QA"].shape[0]
        pad = -n % 8
        layer.qa_padded = torch.nn.functional.pad(d["QA"], (0, pad, 0, pad))
        layer.qa_padded[n:, n:] = torch.eye(pad, device=d["QA"].device)
        scale = 1.0 / (torch.outer(d["dG"], d["dA"]) + self.args.kfac_damping)
        layer.eigen_scale = torch.nn.functional.pad(scale, (0, pad), value=1.0)

    def _precondition(self, lr: float) -> None:
        pairs = [(layer, g) for layer in self.layers if (g := layer.gradient()) is not None]
        vs = [self._preconditioned(layer, g) for layer, g in pairs]
        if self.args.kfac_kl_clip > 0 and vs:
            vg = torch.stack([(v * g).sum() for v, (_, g) in zip(vs, pairs)]).sum().abs() * lr**2
            # vg == 0 gives inf, clamped to 1 (kfac-pytorch returns 1.0 there too).
            nu = torch.sqrt(self.args.kfac_kl_clip / vg).clamp(max=1.0)
            vs = [v * nu for v in vs]
        for (layer, _), v in zip(pairs, vs):
            layer.set_gradient(v)

    def _preconditioned(self, layer: KfacLayer, g: torch.Tensor) -> torch.Tensor:
        d = layer.decomposed
        if self.args.kfac_compute_method == "eigen":
            n, qa = g.shape[1], layer.qa_padded
            g = torch.nn.functional.pad(g, (0, qa.shape[0] - n))
            return (d["QG"] @ ((d["QG"].T @ g @ qa) * layer.eigen_scale) @ qa.T)[:, :n]
        return d["G_inv"] @ g @ d["A_inv"]

    # -- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Steps, running factors and the current decompositions (saved too, so a resumed run
        preconditions with exactly the decomposition the uninterrupted run would), on the CPU."""
        layers = {}
        for layer in self.layers:
            state = {"A": layer.A, "G": layer.G, **layer.decomposed}
            layers[layer.name] = {k: v.detach().cpu().clone() for k, v in state.items() if v is not None}
        return {"steps": self.steps, "compute_method": self.args.kfac_compute_method, "layers": layers}

    def load_state_dict(self, state: dict) -> None:
        """Raises ValueError when the state is of other layers, shapes or --kfac-compute-method."""
        mine = {layer.name: layer for layer in self.layers}
        if set(state["layers"]) != set(mine) or state["compute_method"] != self.args.kfac_compute_method:
            raise ValueError("the K-FAC state is of other layers or another --kfac-compute-method (resume with the "
                             "same --kfac-skip-layers and --kfac-compute-method)")
        for name, saved in state["layers"].items():
            layer = mine[name]
            device = layer.module.weight.device
            for k, shape in (("A", layer.a_sum.shape), ("G", layer.g_sum.shape)):
                if k in saved and saved[k].shape != shape:
                    raise ValueError(f"K-FAC factor {name}.{k} has shape {tuple(saved[k].shape)}, the model's "
                                     f"is {tuple(shape)}")
            layer.A, layer.G = (saved[k].to(device) if k in saved else None for k in ("A", "G"))
            layer.decomposed = {k: v.to(device) for k, v in saved.items() if k not in ("A", "G")}
            if "dA" in layer.decomposed:
                self._eigen_parts(layer)
        self.steps = int(state["steps"])


def build_preconditioner(args: KfacArgs, strategy: Strategy) -> KfacPreconditioner | None:
    """The run's K-FAC preconditioner (None without --kfac). Raises UsageError for layouts whose
    gradients are not whole in every process (pipeline stages, FSDP2)."""
    if not args.kfac:
        return None
    if not strategy.whole_gradients:
        raise UsageError("--kfac needs whole gradients in every process: one process or DDP/ZeRO-1 replicas, not "
                         "pipeline stages (--layers-per-ipu), tensor parallelism or FSDP2 (--zero-stage 2|3, "
                         "--offload full)")
    if args.kfac_inv_update_steps % args.kfac_factor_update_steps:
        log.notice(f"--kfac-inv-update-steps {args.kfac_inv_update_steps} is not a multiple of "
                   f"--kfac-factor-update-steps {args.kfac_factor_update_steps}: some decompositions see no new "
                   "factors")
    kfac = KfacPreconditioner(strategy.model, args, strategy.replica.rank, strategy.replica.world_size)
    log.info(kfac.describe())
    return kfac

