"""``DrafterConfig``: the shape and format of the DSpark drafter (docs/contract.md §5)."""

from dataclasses import dataclass

from .. import formats

__all__ = ["DrafterConfig", "WEIGHT_FORMATS"]

# weight_format -> fp8 block (bn, bk), from the format descriptors; "bf16" has no block and
# never quantizes activations.
WEIGHT_FORMATS = {name: formats.get_format(name).default_block for name in ("fp8", "mxfp8", "bf16")}


@dataclass(frozen=True)
class DrafterConfig:
    """Configuration of :class:`torch_bq.nn.Drafter` / :class:`torch_bq.nn.DrafterLayer`.

    The defaults are the full-size MiniMax-M3.1 DSpark drafter of docs/contract.md §5.

    Attributes:
        hidden_size: ``H``, width of the residual stream.
        num_attention_heads: query heads ``Hq``.
        num_key_value_heads: KV heads ``Hkv``; ``Hq`` must be a multiple (GQA).
        head_dim: ``d``, per-head width.
        rotary_dim: leading dims of each head rotated by RoPE (NeoX halves); even, ``<= d``.
        rope_theta: RoPE base.
        sliding_window: ``W``, positions a row can see back to (its own included).
        intermediate_size: ``I``, FFN width.
        rms_norm_eps: epsilon of every Gemma RMSNorm.
        rows_per_request: query rows per request in a step (the DSpark block).
        num_layers: layers in the :class:`Drafter` stack.
        swiglu_alpha, swiglu_limit: the clamped SwiGLU's sigmoid slope and clamp.
        causal: if true, a row also cannot see later rows of its own request.
        weight_format: ``"fp8"`` (32x32 e8m0 blocks), ``"mxfp8"`` (1x32 e8m0 blocks)
            or ``"bf16"`` (bf16 weights, activations never quantized).
        act_quant: fp8 activation round trip (docs/contract.md §3) before each fp8 linear;
            ignored for ``"bf16"``.
        act_peak: the round trip's peak (224 matches Trainium2).
    """

    hidden_size: int = 6144
    num_attention_heads: int = 64
    num_key_value_heads: int = 4
    head_dim: int = 128
    rotary_dim: int = 64
    rope_theta: float = 5e6
    sliding_window: int = 4096
    intermediate_size: int = 12288
    rms_norm_eps: float = 1e-6
    rows_per_request: int = 7
    num_layers: int = 5
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    causal: bool = False
    weight_format: str = "fp8"
    act_quant: bool = True
    act_peak: float = formats.DEFAULT_ACT_PEAK

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "sliding_window",
            "intermediate_size",
            "rows_per_request",
            "num_layers",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DrafterConfig.{name}: expected a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"DrafterConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention"
            )
        if not isinstance(self.rotary_dim, int) or self.rotary_dim % 2 or not 0 <= self.rotary_dim <= self.head_dim:
            raise ValueError(
                f"DrafterConfig.rotary_dim: expected an even int in [0, head_dim = {self.head_dim}] "
                f"(NeoX RoPE rotates pairs of halves), got {self.rotary_dim!r}"
            )
        for name in ("rope_theta", "rms_norm_eps", "swiglu_alpha", "swiglu_limit"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"DrafterConfig.{name}: expected a positive number, got {value!r}")
        for name in ("causal", "act_quant"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"DrafterConfig.{name}: expected a bool, got {getattr(self, name)!r}")
        if self.weight_format not in WEIGHT_FORMATS:
            raise ValueError(
                f"DrafterConfig.weight_format: expected one of {sorted(WEIGHT_FORMATS)}, got {self.weight_format!r}"
            )
        formats.check_peak(self.act_peak, "DrafterConfig.act_peak")

    @property
    def num_groups(self) -> int:
        """Query heads per KV head."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def qkv_size(self) -> int:
        """Rows of the fused qkv weight: ``(Hq + 2 * Hkv) * d``."""
        return (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim

    @property
    def fp8_block(self):
        """The fp8 block ``(bn, bk)`` of ``weight_format``, or ``None`` for bf16."""
        return WEIGHT_FORMATS[self.weight_format]
