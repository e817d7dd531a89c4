"""RoPE as an HF config.json describes it, and how Megatron-core 0.16.1 reproduces it (GQA families; MLA in
deepseek_v3.py translates the same reading into its own config fields).

HF configs spell RoPE two ways: `rope_scaling` beside a top-level `rope_theta` (transformers < 5, and most released
checkpoints: Llama 3.1/3.2, Qwen2.5), or `rope_parameters` with `rope_theta` inside (what transformers >= 5 writes).
`read_rope` reads either into one `RopeScaling`, with the values transformers itself would use (its defaults and
fallbacks included), and refuses what Megatron cannot reproduce, naming the rope_type and what is supported:

    default  -> GPTModel(position_embedding_type="rope", rotary_base=rope_theta)
    linear   -> + seq_len_interpolation_factor=factor: Megatron divides the positions by the factor, transformers the
                frequencies; the angles are the same products (fp32 rounding apart)
    llama3   -> Megatron's llama3 frequency scaling (RotaryEmbedding._apply_scaling, the formula transformers uses),
                applied after the build with all four of the checkpoint's values (`RopeScaling.fit_rotary`)
    yarn     -> GPTModel(position_embedding_type="yarn"): YarnRotaryEmbedding (the same ramp between interpolated and
                extrapolated frequencies, correction range rounded or not as `truncate` says), reading the yarn_*
                attributes `RopeScaling.config_attributes` puts on the TransformerConfig; the attention scales cos/sin
                by the same attention factor (mscale) transformers derives from factor, mscale and mscale_all_dim

Refused: every other rope_type (dynamic and longrope change the frequencies with the sequence length at run time;
no Megatron equivalent), per-layer rope parameters, partial_rotary_factor != 1 with a scaled rope, and a yarn
`attention_factor` that differs from the one Megatron derives.

Checked against transformers' Llama and Qwen3 logits by tests/test_rope_scaling.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from mcore_rl.models.base import HFConfig, UnsupportedModel

#: rope types a GQA family (Llama, Qwen2, Qwen3, Qwen3-MoE) reproduces exactly in Megatron
GQA_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention-scale term for a context `factor` (1 when the context is not extended)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class RopeScaling:
    """One model's RoPE, with the values transformers computes it from (unused fields keep their defaults)."""

    model_type: str
    #: default | linear | llama3 | yarn
    rope_type: str
    #: the base of the rotary frequencies
    theta: float
    #: the context extension factor (linear, llama3, yarn)
    factor: float = 1.0
    #: the pretraining context length the scaled rope types are defined against (llama3, yarn)
    original_max_position_embeddings: int | None = None
    #: llama3: wavelengths above original / low_freq_factor are divided by the factor, below original /
    #: high_freq_factor kept, and smoothly interpolated between
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    #: yarn: rotations bounding the ramp between extrapolated and interpolated dims
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    #: yarn: the attention factor's numerator and denominator terms, as config.json gives them (None: absent)
    mscale: float | None = None
    mscale_all_dim: float | None = None
    #: yarn: round the correction range to whole dims (transformers' `truncate`, default true)
    truncate: bool = True

    def attention_factor(self) -> float:
        """The factor transformers multiplies cos and sin by (yarn; 1 otherwise), from factor, mscale and
        mscale_all_dim: mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set (non-zero), else
        mscale(factor)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def fusion_allowed(self) -> bool:
        """Whether TE's fused RoPE computes this rope (0.16.1's fused kernel refuses an mscale != 1: yarn)."""
        return self.rope_type != "yarn"

    def config_attributes(self) -> dict[str, Any]:
        """Attributes to set on a GQA model's TransformerConfig after it is built (yarn only).

        Megatron 0.16.1's GPTModel(position_embedding_type="yarn") reads `yarn_*` attributes of the config that are
        not TransformerConfig fields (getattr, no default), and the attention scales cos/sin by their
        concentration factor, which is transformers' attention factor: mscale(factor) when either mscale term is
        None, their ratio otherwise. transformers falls back to mscale(factor) when either is 0 or absent, so those
        become None here."""
        if self.rope_type != "yarn":
            return {}
        both = bool(self.mscale and self.mscale_all_dim)
        return dict(
            yarn_rotary_scaling_factor=self.factor,
            yarn_original_max_position_embeddings=self.original_max_position_embeddings,
            yarn_beta_fast=self.beta_fast,
            yarn_beta_slow=self.beta_slow,
            yarn_mscale=self.mscale if both else None,
            yarn_mscale_all_dim=self.mscale_all_dim if both else None,
            yarn_correction_range_round_to_int=self.truncate,
        )

    def gpt_model_arguments(self, config: Any) -> dict[str, Any]:
        """GPTModel's position-embedding arguments for a model of this `config` (a TransformerConfig).

        MLA builds its own rotary embedding from the config's rope fields and GPTModel builds none, so an MLA model
        takes plain "rope" here whatever its rope type."""
        if config.multi_latent_attention:
            return dict(position_embedding_type="rope", rotary_base=config.rotary_base)
        kwargs: dict[str, Any] = dict(
            position_embedding_type="yarn" if self.rope_type == "yarn" else "rope", rotary_base=self.theta
        )
        if self.rope_type == "linear" and self.factor != 1.0:
            kwargs["seq_len_interpolation_factor"] = self.factor
        # llama3 is not passed as GPTModel(rope_scaling=True): 0.16.1 forwards only the factor and fixes
        # low_freq_factor=1, high_freq_factor=4, original_max_position_embeddings=8192 (see `fit_rotary`).
        return kwargs

    def fit_rotary(self, model: torch.nn.Module) -> None:
        """Give a built GPTModel chunk this rope's frequencies where GPTModel's arguments cannot (llama3).

        Megatron 0.16.1's RotaryEmbedding applies llama3 scaling with the factor GPTModel passes and the Llama 3.1
        values of the other three (low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192);
        its `_apply_scaling` takes all four. So the model is built without rope_scaling (unscaled frequencies) and
        they are scaled here once, with the checkpoint's values, before any forward (the rotary forward caches its
        output per sequence length). `inv_freq` is a plain attribute, never part of a checkpoint."""
        rotary = getattr(model, "rotary_pos_emb", None)
        if self.rope_type != "llama3" or rotary is None:
            return
        rotary.inv_freq = rotary._apply_scaling(
            rotary.inv_freq,
            factor=self.factor,
            low_freq_factor=self.low_freq_factor,
            high_freq_factor=self.high_freq_factor,
            original_max_position_embeddings=self.original_max_position_embeddings,
        )


def rope_parameters(hf: HFConfig) -> dict[str, Any]:
    """The rope settings of a config.json in one dict: `rope_scaling` overlaid with `rope_parameters`."""
    return {**(hf.raw.get("rope_scaling") or {}), **(hf.raw.get("rope_parameters") or {})}


def read_rope(hf: HFConfig, supported: tuple[str, ...] = GQA_ROPE_TYPES) -> RopeScaling:
    """The model's RoPE from either config.json form; UnsupportedModel naming the setting for anything outside
    `supported` (the rope types the calling family reproduces) or without a Megatron equivalent."""
    where = f"{hf.model_type} config.json"
    params = rope_parameters(hf)
    if any(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModel(f"{where}: per-layer rope parameters ({sorted(params)}) are not supported")
    kind = params.get("rope_type", params.get("type")) or "default"
    if kind not in supported:
        raise UnsupportedModel(
            f"{where}: rope_type={kind!r} is not supported for {hf.model_type} (supported: {', '.join(supported)})"
        )
    theta = params.get("rope_theta", hf.raw.get("rope_theta"))
    if theta is None:
        raise UnsupportedModel(f"{where}: rope_theta is missing")
    if kind == "default":
        return RopeScaling(hf.model_type, kind, float(theta))

    def number(name: str, default: Any = None) -> Any:
        value = params.get(name)
        if value is None:
            if default is None:
                raise UnsupportedModel(f"{where}: rope_type={kind!r} needs rope field {name!r}")
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UnsupportedModel(f"{where}: rope field {name}={value!r} is not a number")
        return value

    partial = params.get("partial_rotary_factor", hf.raw.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise UnsupportedModel(f"{where}: partial_rotary_factor={partial!r} with rope_type={kind!r} is not supported")
    if kind == "linear":
        return RopeScaling(hf.model_type, kind, float(theta), factor=float(number("factor")))
    # transformers gives a top-level original_max_position_embeddings priority, then the rope dict's, then
    # max_position_embeddings (PreTrainedConfig.standardize_rope_params).
    original = hf.raw.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
    original = int(original or hf.req("max_position_embeddings"))
    if kind == "llama3":
        low, high = float(number("low_freq_factor")), float(number("high_freq_factor"))
        if low >= high:
            raise UnsupportedModel(f"{where}: llama3 low_freq_factor={low} must be below high_freq_factor={high}")
        return RopeScaling(
            hf.model_type, kind, float(theta), factor=float(number("factor")),
            original_max_position_embeddings=original, low_freq_factor=low, high_freq_factor=high,
        )  # fmt: skip
    # yarn: a missing factor is the context ratio, as transformers computes it
    factor = params.get("factor") or hf.req("max_position_embeddings") / original
    rope = RopeScaling(
        hf.model_type, kind, float(theta), factor=float(factor), original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
        truncate=params.get("truncate", True) is not False,
    )  # fmt: skip
    explicit = params.get("attention_factor")
    if explicit is not None and not math.isclose(float(explicit), rope.attention_factor()):
        raise UnsupportedModel(
            f"{where}: yarn attention_factor={explicit} is not supported (Megatron derives "
            f"{rope.attention_factor():.6g} from factor, mscale and mscale_all_dim)"
        )
    return rope
