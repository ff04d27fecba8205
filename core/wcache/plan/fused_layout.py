"""The fused layout: the model family's tensors as engines hold them, sharded for one TP rank.

Attention's q, k and v stacked into qkv_proj and the MLP's gate and up into gate_up_proj (vLLM's
`packed_modules_mapping`), column- and row-parallel shards, the vocabulary padded and split as vLLM splits it,
a mixture of experts stacked as vLLM's FusedMoE holds it, and pre-quantized checkpoints' scales beside their
codes. It says which checkpoint slices make each output; the plan's builder (`processing`) chooses dtypes and
quantizes. Imports no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Generic, Protocol, TypeVar

from wcache.checkpoint.manifest import TensorDigest
from wcache.errors import option
from wcache.plan import family
from wcache.plan.family import ModelDims, UnsupportedPlanError
from wcache.plan.spec import PlanSpec

_ROTARY_BUFFER = ".rotary_emb.inv_freq"
# vLLM's DEFAULT_VOCAB_PADDING_SIZE: it pads the vocabulary to a multiple of it before splitting it across ranks.
VOCAB_PADDING = 64

P = TypeVar("P")


class Builder(Protocol[P]):
    """What the layout asks of the plan's builder: a slice of a checkpoint tensor (a `P`), and outputs made of
    slices, added in the plan's order."""

    spec: PlanSpec
    manifest: Mapping[str, TensorDigest]
    prequantized: bool  # config.json declares a quantization_config: its codes and scales are held as stored

    def piece(self, name: str, dim: int | None = None, start: int = 0, length: int = 0) -> P:
        """`length` indices of checkpoint tensor `name` from `start` along `dim`, or all of it if `dim` is None."""
        ...

    def whole(self, name: str) -> None:
        """An output that is a checkpoint tensor unchanged but for its dtype."""
        ...

    def add(self, name: str, pieces: tuple[P, ...], shape: tuple[int, ...], sources: tuple[str, ...] = (),
            dtype: str | None = None) -> None:
        """An output stacked from `pieces` along dim 0; `dtype` overrides the plan's for floating sources."""
        ...


def check_split(tp: int, d: ModelDims) -> None:
    """UnsupportedPlanError unless TP size `tp` splits every sharded dimension of a model with these dimensions."""
    if d.heads % tp:
        raise UnsupportedPlanError(f"{d.heads} attention heads cannot be split evenly across {option('tp_size', tp)}.")
    if d.kv_heads % tp and tp % d.kv_heads:
        raise UnsupportedPlanError(
            f"{d.kv_heads} key/value heads can be neither split nor replicated evenly across {option('tp_size', tp)}."
        )
    if len(d.sparse_layers) < d.layers and d.intermediate % tp:
        raise UnsupportedPlanError(f"intermediate_size {d.intermediate} cannot be split evenly across "
                                   f"{option('tp_size', tp)}.")
    if d.is_moe and d.expert_intermediate % tp:
        raise UnsupportedPlanError(
            f"moe_intermediate_size {d.expert_intermediate} cannot be split evenly across {option('tp_size', tp)}."
        )


class _Shards(Generic[P]):
    """How one rank slices the family's projections, and the fusions it makes of them."""

    def __init__(self, b: Builder[P], d: ModelDims) -> None:
        self.b, self.d = b, d
        tp, rank = b.spec.tp_size, b.spec.tp_rank
        self.tp, self.rank = tp, rank
        # Column-parallel attention: rank r holds a contiguous block of query heads and the key/value heads they
        # read. With fewer kv heads than ranks each kv head is replicated, and rank r holds head r*kv//tp
        # (vLLM's rule).
        self.q_rows = d.heads // tp * d.head_dim
        self.kv_start = rank * d.kv_heads // tp * d.head_dim
        self.kv_rows = max(d.kv_heads // tp, 1) * d.head_dim

    def rows(self, name: str, start: int, length: int) -> P:
        return self.b.piece(name, 0, start, length)

    def cols(self, name: str, start: int, length: int) -> P:
        return self.b.piece(name, 1, start, length)

    def column_parallel(self, fused: str, parts: list[tuple[str, int, int]], cols: int) -> None:
        """`fused.weight` from rows [start, start+length) of each part's weight, and each companion alike.

        Per-channel companions (scales, zero points: one row per output row) are sliced and stacked with the
        weight's rows; the others (per-tensor) are held whole for the engine's own loader.
        """
        pieces = tuple(self.rows(f"{part}.weight", start, length) for part, start, length in parts)
        self.b.add(f"{fused}.weight", pieces, (sum(length for _, _, length in parts), cols))
        for suffix in family.PREQUANTIZED_SUFFIXES:
            names = [f"{part}.{suffix}" for part, _, _ in parts]
            present = [n for n in names if n in self.b.manifest]
            if not present:
                continue
            if len(present) < len(names):
                raise UnsupportedPlanError(f"{names[len(present)]!r} is missing beside {present[0]!r}, so "
                                           f"{fused}.{suffix} cannot be fused.")
            shapes = [(tuple(self.b.manifest[n].shape), self.b.manifest[f"{part}.weight"].shape[0])
                      for n, (part, _, _) in zip(names, parts, strict=True)]
            if not all(len(shape) in (1, 2) and shape[0] == rows for shape, rows in shapes):
                for name in names:
                    self._companion_whole(name)
                continue
            trailing = tuple(self.b.manifest[names[0]].shape[1:])
            stacked = tuple(self.rows(n, start, length) for n, (_, start, length) in zip(names, parts, strict=True))
            self.b.add(f"{fused}.{suffix}", stacked, (sum(length for _, _, length in parts), *trailing),
                       dtype=family.SCALE_DTYPE)

    def row_parallel(self, module: str, start: int, length: int, rows: int) -> None:
        """`module.weight` from columns [start, start+length); its companions (per output row) whole."""
        self.b.add(f"{module}.weight", (self.cols(f"{module}.weight", start, length),), (rows, length))
        for suffix in family.PREQUANTIZED_SUFFIXES:
            name = f"{module}.{suffix}"
            if name in self.b.manifest:
                self._companion_whole(name)

    def _companion_whole(self, name: str) -> None:
        entry = self.b.manifest[name]
        self.b.add(name, (self.b.piece(name),), tuple(entry.shape), dtype=family.SCALE_DTYPE)

    def experts(self, i: int) -> None:
        """The router whole, and every expert's projections stacked as the engine holds them (vLLM's FusedMoE)."""
        d, b = self.d, self.b
        b.whole(f"{family.mlp(i)}.{family.ROUTER}.weight")
        inter = d.expert_intermediate // self.tp
        start = self.rank * inter
        w13: list[P] = []
        w2: list[P] = []
        for e in range(d.experts):
            prefix = family.expert(i, e)
            w13 += [self.rows(f"{prefix}.{part}.weight", start, inter) for part in family.EXPERT_STACKS["w13_weight"]]
            w2 += [self.cols(f"{prefix}.{part}.weight", start, inter) for part in family.EXPERT_STACKS["w2_weight"]]
        b.add(family.expert_stack(i, "w13_weight"), tuple(w13), (d.experts, 2 * inter, d.hidden))
        b.add(family.expert_stack(i, "w2_weight"), tuple(w2), (d.experts, d.hidden, inter))
        self._expert_scales(i, start, inter)

    def _expert_scales(self, i: int, start: int, inter: int) -> None:
        """A pre-quantized checkpoint's per-channel expert scales stacked as the codes are, in the shapes vLLM's
        FusedMoE holds for a channel strategy: `w13_weight_scale` [experts, 2 × inter, 1] (this rank's rows of
        gate and up), `w2_weight_scale` [experts, hidden, 1] (down_proj's output rows, whole on every rank).

        Any other expert companion (a per-tensor or grouped scale, a zero point, an input scale) is refused:
        the fused layout would have to drop it, and an engine would then run the codes with the wrong scales.
        """
        d, b = self.d, self.b
        stacks = {stack: [f"{family.expert(i, e)}.{part}" for e in range(d.experts) for part in parts]
                  for stack, parts in family.EXPERT_STACKS.items()}
        modules = [module for parts in stacks.values() for module in parts]
        for module in modules:
            rows = b.manifest[f"{module}.weight"].shape[0]
            for suffix in family.PREQUANTIZED_SUFFIXES:
                name = f"{module}.{suffix}"
                shape = tuple(b.manifest[name].shape) if name in b.manifest else None
                if shape is not None and (suffix != "weight_scale" or shape != (rows, 1)):
                    raise UnsupportedPlanError(
                        f"expert tensor {name!r} of shape {shape} cannot be stacked: the fused layout holds only "
                        "per-channel expert weight scales ([rows, 1], as vLLM's fused MoE does); use "
                        f"{option('layout', 'identity')}."
                    )
        scales = [f"{module}.weight_scale" for module in modules]
        present = [name for name in scales if name in b.manifest]
        if not present:
            return
        if len(present) < len(scales):
            missing = next(name for name in scales if name not in b.manifest)
            raise UnsupportedPlanError(f"{missing!r} is missing beside {present[0]!r}, so the experts' scales "
                                       "cannot be stacked.")
        w13 = tuple(self.rows(f"{m}.weight_scale", start, inter) for m in stacks["w13_weight"])
        w2 = tuple(self.rows(f"{m}.weight_scale", 0, d.hidden) for m in stacks["w2_weight"])
        b.add(family.expert_stack(i, "w13_weight_scale"), w13, (d.experts, 2 * inter, 1), dtype=family.SCALE_DTYPE)
        b.add(family.expert_stack(i, "w2_weight_scale"), w2, (d.experts, d.hidden, 1), dtype=family.SCALE_DTYPE)


def build(b: Builder[P], d: ModelDims) -> None:
    """Every output of the fused layout for `b`'s rank, in the plan's order, after checking the checkpoint's
    names and shapes against config.json's dimensions."""
    manifest = b.manifest
    check_split(b.spec.tp_size, d)
    _check_names_and_shapes(manifest, d, b.prequantized)
    s: _Shards[P] = _Shards(b, d)
    q_rows, kv_start, kv_rows, rank = s.q_rows, s.kv_start, s.kv_rows, s.rank
    inter = d.intermediate // s.tp
    _vocab_parallel(b, family.EMBED, d)
    for i in range(d.layers):
        p, a, m = family.layer(i), family.attention(i), family.mlp(i)
        b.whole(f"{p}.input_layernorm.weight")
        qkv = [(f"{a}.q_proj", rank * q_rows, q_rows), (f"{a}.k_proj", kv_start, kv_rows),
               (f"{a}.v_proj", kv_start, kv_rows)]
        s.column_parallel(f"{a}.{family.QKV}", qkv, d.hidden)
        present = [n for n in (f"{a}.q_proj.bias", f"{a}.k_proj.bias", f"{a}.v_proj.bias") if n in manifest]
        if 0 < len(present) < 3:
            raise UnsupportedPlanError(
                f"layer {i} has a bias for only some of q, k and v, so qkv_proj cannot be fused."
            )
        if present:
            biases = (s.rows(f"{a}.q_proj.bias", rank * q_rows, q_rows),
                      s.rows(f"{a}.k_proj.bias", kv_start, kv_rows), s.rows(f"{a}.v_proj.bias", kv_start, kv_rows))
            b.add(f"{a}.qkv_proj.bias", biases, (q_rows + 2 * kv_rows,))
        s.row_parallel(f"{a}.o_proj", rank * q_rows, q_rows, d.hidden)
        # A row-parallel bias is added once after the all-reduce, so every rank keeps all of it.
        for optional in (f"{a}.o_proj.bias", f"{a}.q_norm.weight", f"{a}.k_norm.weight"):
            if optional in manifest:
                b.whole(optional)
        b.whole(f"{p}.post_attention_layernorm.weight")
        if i in d.sparse_layers:
            s.experts(i)
            continue
        s.column_parallel(f"{m}.{family.GATE_UP}", [(f"{m}.gate_proj", rank * inter, inter),
                                                    (f"{m}.up_proj", rank * inter, inter)], d.hidden)
        s.row_parallel(f"{m}.down_proj", rank * inter, inter, d.hidden)
    b.whole(family.FINAL_NORM)
    # Tied embeddings: the engine reuses embed_tokens, so lm_head exists only if the checkpoint stores one
    # (Qwen3-0.6B does, tied or not); the engine then uses the stored bytes, exactly as transformers does.
    if family.LM_HEAD in manifest:
        _vocab_parallel(b, family.LM_HEAD, d)


def _check_names_and_shapes(manifest: Mapping[str, TensorDigest], d: ModelDims, prequantized: bool) -> None:
    """UnsupportedPlanError for a tensor the layout does not know, one it needs and lacks, or a shape other than
    config.json implies."""
    expected, required = _expected_shapes(d)
    known = [n for n in manifest if n in expected or n.endswith(_ROTARY_BUFFER)
             or (prequantized and _is_companion(n, expected))]
    unknown = sorted(set(manifest) - set(known))
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise UnsupportedPlanError(
            f"the fused plan does not know tensor {unknown[0]!r}{more}; use {option('layout', 'identity')} to load "
            "it by name."
        )
    missing = [n for n in required if n not in manifest]
    if missing:
        raise UnsupportedPlanError(f"the checkpoint lacks {missing[0]!r}, which the fused plan needs.")
    for name, entry in manifest.items():
        shape = expected.get(name)
        if shape is not None and tuple(entry.shape) != shape:
            raise UnsupportedPlanError(
                f"tensor {name!r} has shape {tuple(entry.shape)} but config.json implies {shape}."
            )


def _is_companion(name: str, expected: Mapping[str, tuple[int, ...]]) -> bool:
    """Whether `name` is a pre-quantized projection's scale or zero point (`x.weight_scale` beside `x.weight`)."""
    module, _, suffix = name.rpartition(".")
    return suffix in family.PREQUANTIZED_SUFFIXES and family.is_projection(f"{module}.weight") and (
        f"{module}.weight" in expected)


def vocab_rows_per_rank(vocab: int, tp: int) -> int:
    """Rows of a vocab-parallel tensor (embed_tokens, lm_head) on each of `tp` ranks.

    TP 1 keeps the checkpoint's shape (what transformers and the reference engine load). Split, the vocab is
    first padded with zero rows to a multiple of VOCAB_PADDING, as vLLM pads it, so that each rank's shard is
    exactly vLLM's parameter; every rank's shard has one shape, and engines mask logits past vocab_size.
    """
    if tp == 1:
        return vocab
    padded = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING
    return -(-padded // tp)


def _vocab_parallel(b: Builder[P], name: str, d: ModelDims) -> None:
    tp, rank = b.spec.tp_size, b.spec.tp_rank
    per_rank = vocab_rows_per_rank(d.vocab, tp)
    start = rank * per_rank
    real = max(0, min(per_rank, d.vocab - start))
    pieces = (b.piece(name, 0, start, real),) if real else ()
    b.add(name, pieces, (per_rank, d.hidden), sources=(name,))


def _expected_shapes(d: ModelDims) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """Every tensor name the fused plan understands with its shape, and those it cannot do without."""
    q_out, kv_out = d.heads * d.head_dim, d.kv_heads * d.head_dim
    expected: dict[str, tuple[int, ...]] = {
        family.EMBED: (d.vocab, d.hidden),
        family.FINAL_NORM: (d.hidden,),
        family.LM_HEAD: (d.vocab, d.hidden),
    }
    required = [family.EMBED, family.FINAL_NORM]
    if not d.tie:
        required.append(family.LM_HEAD)
    for i in range(d.layers):
        a = family.attention(i)
        layer = {leaf.name: leaf.shape for leaf in family.layer_leaves(d, i, qk_norm=False)}
        required.extend(layer)
        expected.update(layer)
        expected.update({
            f"{a}.q_norm.weight": (d.head_dim,),
            f"{a}.k_norm.weight": (d.head_dim,),
            f"{a}.q_proj.bias": (q_out,),
            f"{a}.k_proj.bias": (kv_out,),
            f"{a}.v_proj.bias": (kv_out,),
            f"{a}.o_proj.bias": (d.hidden,),
        })
    return expected, required
