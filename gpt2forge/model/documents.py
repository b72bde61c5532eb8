"""Packed documents: which document each token belongs to, and the attention mask keeping them apart.

A packed sample holds documents end to end, each ended by the end-of-document (EOD) token.
Megatron's flags (megatron.core.datasets.gpt_dataset._get_ltor_masks_and_position_ids) mean:
- `--reset-position-ids`: positions restart at 0 after each EOD of the input;
- `--reset-attention-mask`: a token attends only to earlier tokens of its own document (an EOD
  belongs to the document it ends);
- `--eod-mask-loss`: no loss where the *input* token is an EOD, i.e. on the prediction of the next
  document's first token made from the previous document (the EOD target itself is still scored).

The flags are `DocumentArgs`, a section of the run's configuration; `document_inputs` applies them
to a micro-batch: `document_layout` derives the position and document ids from the input ids (a
cumulative sum over EOD flags), `eod_masked_labels` applies `--eod-mask-loss`. The model turns
document ids into one `DocumentMask` per forward, shared by its blocks: the dense (B, 1, T, T)
block-causal mask for SDPA, or on CUDA a FlexAttention block mask (tiles that no query of a
document needs are skipped, nothing (T, T) is materialized). A micro-batch whose rows each hold one
document gets no ids at all, so it costs exactly what plain causal attention costs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch

from gpt2forge.core.flags import opt
from gpt2forge.core.labels import IGNORE_INDEX


@dataclasses.dataclass
class DocumentArgs:
    """Packed documents: Megatron's flags that keep the documents of a packed sample apart."""

    reset_position_ids: bool = opt(False, kind="bool")
    """positions restart at 0 after each end-of-document token (Megatron's)"""
    reset_attention_mask: bool = opt(False, kind="bool")
    """a token attends only within its own document of a packed sample (block-causal mask; Megatron's)"""
    eod_mask_loss: bool = opt(False, kind="bool")
    """no loss where the input token is end-of-document, i.e. on the next document's first token (Megatron's)"""

    @property
    def enabled(self) -> bool:
        """Whether any flag is on: samples are then split into documents at their end-of-document tokens."""
        return self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss


class DocumentLayout(NamedTuple):
    """Per-token ids of one micro-batch; None where the flag is off or the batch does not need them."""

    position_ids: torch.Tensor | None
    """(B, T) int64 position within the token's document, for the position embedding."""
    document_ids: torch.Tensor | None
    """(B, T) int64 document index of each token within its row (0, 1, ...), for the attention mask."""


def document_layout(input_ids: torch.Tensor, eod: int, reset_position_ids: bool, reset_attention_mask: bool,
                    always: bool = False) -> DocumentLayout:
    """Position ids (`reset_position_ids`) and document ids (`reset_attention_mask`) of input ids (B, T).

    An EOD at input position t ends its document; the next starts at t + 1. When no row has an EOD
    before its last input position, every row is one document: both are None (plain positions and
    causal attention are then exactly the same) unless `always` (a pipeline schedule, whose stages
    take the same arguments in every call). One host sync (the `any`) unless `always`.
    """
    if not (reset_position_ids or reset_attention_mask):
        return DocumentLayout(None, None)
    B, T = input_ids.shape
    ends = input_ids[:, :-1] == eod  # (B, T - 1): an EOD at t starts a document at t + 1
    if not always and not bool(ends.any()):
        return DocumentLayout(None, None)
    starts = torch.cat([torch.ones(B, 1, dtype=torch.bool, device=input_ids.device), ends], dim=1)  # (B, T)
    position_ids = None
    if reset_position_ids:
        t = torch.arange(T, device=input_ids.device)
        first = torch.where(starts, t, 0).cummax(dim=1).values  # (B, T) index of the document's first token
        position_ids = t - first
    document_ids = starts.cumsum(dim=1) - 1 if reset_attention_mask else None
    return DocumentLayout(position_ids, document_ids)


def eod_masked_labels(input_ids: torch.Tensor, labels: torch.Tensor, eod: int) -> torch.Tensor:
    """`labels` (B, T) with IGNORE_INDEX where the input token is an EOD (Megatron's --eod-mask-loss)."""
    return labels.masked_fill(input_ids == eod, IGNORE_INDEX)


def document_inputs(args: DocumentArgs, input_ids: torch.Tensor, labels: torch.Tensor, eod: int,
                    always: bool = False) -> tuple[torch.Tensor, DocumentLayout]:
    """A micro-batch's input ids and labels (B, T each) under the flags: the labels (EOD inputs unscored
    with --eod-mask-loss) and the ids of `document_layout` (`always` as there)."""
    if args.eod_mask_loss:
        labels = eod_masked_labels(input_ids, labels, eod)
    return labels, document_layout(input_ids, eod, args.reset_position_ids, args.reset_attention_mask, always=always)


class DocumentMask(NamedTuple):
    """Block-causal attention over the documents of each row, built once per forward."""

    ids: torch.Tensor
    """(B, T) document index of each token."""
    starts: torch.Tensor
    """(B, T) index of the first token of each token's document (the lowest key it may see)."""
    dense: torch.Tensor | None
    """(B, 1, T, T) bool, True where query t may attend key s (SDPA's attn_mask), or None."""
    block: Any = None
    """A FlexAttention BlockMask (CUDA), or None."""


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) index of the first token of each token's document."""
    B, T = document_ids.shape
    t = torch.arange(T, device=document_ids.device)
    new = torch.ones_like(document_ids, dtype=torch.bool)
    new[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return torch.where(new, t, 0).cummax(dim=1).values


def dense_document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool: query t may attend key s when s <= t and both are in the same document."""
    T = document_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=document_ids.device).tril()
    return ((document_ids[:, :, None] == document_ids[:, None, :]) & causal).unsqueeze(1)


def document_mask(document_ids: torch.Tensor, dense: bool, flex: bool) -> DocumentMask:
    """The mask of document ids (B, T): with the dense (B, 1, T, T) mask when `dense`, with a
    FlexAttention block mask when `flex` (CUDA)."""
    block = flex_block_mask(document_ids) if flex else None
    return DocumentMask(document_ids, document_starts(document_ids),
                        dense_document_mask(document_ids) if dense else None, block)


def flex_available() -> bool:
    """Whether this PyTorch has FlexAttention (torch.nn.attention.flex_attention, PyTorch >= 2.5)."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def flex_block_mask(document_ids: torch.Tensor):
    """A FlexAttention BlockMask of block-causal attention over the documents of each row: tiles
    (128 x 128) whose queries and keys share no document are skipped, none is stored as (T, T)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(b, h, q, kv):
        return (document_ids[b, q] == document_ids[b, kv]) & (q >= kv)

    B, T = document_ids.shape
    return create_block_mask(same_document_causal, B, None, T, T, device=document_ids.device)


def flex_window_mask(document_ids: torch.Tensor | None, T: int, window: int, device: torch.device):
    """A FlexAttention BlockMask of local attention (GPT-Neo): query q sees keys q - window < kv <= q,
    and with `document_ids` (B, T) only those of its own document. Tiles outside the band are skipped."""
    from torch.nn.attention.flex_attention import create_block_mask

    def local_causal(b, h, q, kv):
        near = (q >= kv) & (q - kv < window)
        return near if document_ids is None else near & (document_ids[b, q] == document_ids[b, kv])

    B = None if document_ids is None else document_ids.shape[0]
    return create_block_mask(local_causal, B, None, T, T, device=device)


_COMPILED_FLEX = None


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask, scale: float) -> torch.Tensor:
    """FlexAttention of q, k, v (B, H, T, hd) under `block_mask`, compiled once (eager FlexAttention
    materializes the scores; inside a compiled model the call is traced instead)."""
    global _COMPILED_FLEX
    from torch.nn.attention.flex_attention import flex_attention as flex

    if torch.compiler.is_compiling():
        return flex(q, k, v, block_mask=block_mask, scale=scale)
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex, dynamic=False)
    return _COMPILED_FLEX(q, k, v, block_mask=block_mask, scale=scale)
