"""The transformers oracle (docs/engine.md, "Checked against transformers"):
tiny random models built with transformers' own classes, saved to a folder
that hybridkv.Engine loads, and checks of the engine's tokens and logits
against one no-cache transformers forward over prompt + generated tokens."""

from __future__ import annotations

import os

import torch

# Tokens are judged by logit[token] >= max - TIE: random tiny models have
# near-ties between their top two logits.
TIE = 1e-4


def build(family: str, path: str, sliding_window: int = 8, seed: int = 0, dtype=torch.float32,
          head_dim: int | None = None) -> str:
    """A small random model of `family` saved at `path`. `head_dim` (Gemma-3,
    gpt-oss and Jamba) widens the attention heads for kernels that take no smaller
    ones (FlashInfer: 64 and up); by default they are 16 wide (Jamba: 8)."""
    from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, JambaConfig,
                              JambaForCausalLM)

    torch.manual_seed(seed)
    if family == "gemma3":
        config = Gemma3TextConfig(
            vocab_size=211, hidden_size=48, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=head_dim or 16, sliding_window=sliding_window,
            query_pre_attn_scalar=head_dim or 16,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            max_position_embeddings=512, final_logit_softcapping=30.0, rope_local_base_freq=10000.0,
            rope_theta=1000000.0)
        model = Gemma3ForCausalLM(config)
    elif family == "gemma2":
        config = Gemma2Config(
            vocab_size=211, hidden_size=48, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, sliding_window=sliding_window, query_pre_attn_scalar=16,
            max_position_embeddings=512, final_logit_softcapping=30.0, attn_logit_softcapping=50.0)
        model = Gemma2ForCausalLM(config)
    elif family in ("mistral", "ministral"):
        from transformers import MinistralConfig, MinistralForCausalLM, MistralConfig, MistralForCausalLM

        common = dict(vocab_size=211, hidden_size=48, intermediate_size=96, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=sliding_window,
                      max_position_embeddings=512)
        if family == "mistral":
            model = MistralForCausalLM(MistralConfig(**common))
        else:
            layer_types = ["sliding_attention", "full_attention"] * 2
            model = MinistralForCausalLM(MinistralConfig(**common, layer_types=layer_types))
    elif family == "gpt_oss":
        from transformers import GptOssConfig, GptOssForCausalLM

        # Alternating window and full layers, sinks, experts; YaRN as the
        # released configs (scaled down); a SwiGLU limit the tiny weights reach.
        config = GptOssConfig(
            vocab_size=211, hidden_size=48, intermediate_size=40, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=head_dim or 16, sliding_window=sliding_window, num_local_experts=4,
            num_experts_per_tok=2, max_position_embeddings=512, swiglu_limit=0.2,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128,
                                 beta_fast=32.0, beta_slow=1.0, truncate=False))
        model = GptOssForCausalLM(config)
    elif family == "jamba":
        config = JambaConfig(  # (its heads are hidden_size / num_attention_heads wide)
            vocab_size=211, hidden_size=4 * head_dim if head_dim else 32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
            expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4,
            mamba_expand=2, mamba_dt_rank=4, max_position_embeddings=512)
        model = JambaForCausalLM(config)
    elif family in RECURRENT_FAMILIES or family.startswith("qwen3") or family == "bamba_one_group":
        model = recurrent_family(family)
    else:
        raise ValueError(family)
    # Random init leaves A_log at log(1..N) and dt small; perturb the Mamba
    # parameters so the recurrent state really matters in the comparison.
    # gpt-oss's sinks start near 0 and its experts' biases at 0: make both
    # matter (a sink ignored anywhere then moves the logits).
    recurrent = family in RECURRENT_FAMILIES or family == "bamba_one_group"
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("A_log", "mamba.D", "mixer.D", "dt_bias")) or "dt_proj.bias" in name:
                param.add_(0.3 * torch.randn_like(param))
            if recurrent and name.endswith(("mamba.D", "mixer.D")):
                # Mamba-2: the skip term D x small beside what the state carries
                # (a state written wrong must show in the logits, not drown in D x),
                # and steps dt = softplus(dt_bias + ...) of 0.1-2, not the init's 0.001-0.1.
                param.mul_(0.1)
            if recurrent and name.endswith("dt_bias"):
                param.copy_(torch.randn_like(param))
            if family.startswith("qwen3") and name.endswith("A_log"):
                # Decays exp(-A softplus(...)) with A in 0.1-1, not the init's up to 16 (which
                # forgets the state within a token or two: a wrong one would hardly show).
                param.copy_(torch.empty_like(param).uniform_(0.1, 1.0).log())
            if family.startswith("qwen3") and name.endswith("norm.weight"):
                param.add_(0.3 * torch.randn_like(param))  # the (1 + w) norms start at w = 0, the gated one at 1
            if name.endswith("sinks"):
                param.add_(2.0 * torch.randn_like(param))
            elif name.endswith("_proj_bias"):
                param.add_(0.05 * torch.randn_like(param))
    model = model.to(dtype).eval()
    model.save_pretrained(path)
    return path


# The families whose recurrent layers are Mamba-2 (SSD) or short convolutions,
# tiny: hidden 64, Mamba-2 with 8 heads of 16 channels in 2 groups of B/C
# (state 8, conv 4); every config scalar that changes the math set away
# from its neutral value (Granite's and Falcon-H1's multipliers), MoE where
# the family has it, and transformers' own chunked scan in chunks of 8.
RECURRENT_FAMILIES = ("nemotron_h", "granite_hybrid", "bamba", "falcon_h1", "lfm2", "qwen3_next", "qwen3_5")
# Qwen3-Next and Qwen3.5: Gated DeltaNet with 2 key heads of 16 and 4 value
# heads of 8 channels (each key head serving two), conv 4; gated attention
# on one layer of four with partial rotary; Qwen3-Next's experts on some layers.
_GATED_DELTA = dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention", "linear_attention",
                                                      "linear_attention"], head_dim=16, intermediate_size=96,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=8, linear_conv_kernel_dim=4)
_MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
               mamba_chunk_size=8)
_COMMON = dict(vocab_size=211, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               initializer_range=0.1)  # (projections wide enough that B, C and the conv window carry weight)


def recurrent_family(family: str):
    import transformers as tf

    if family == "nemotron_h":
        config = tf.NemotronHConfig(
            **_COMMON, head_dim=16, intermediate_size=96,
            layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention", "moe"],
            mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=8, conv_kernel=4, chunk_size=8,
            n_routed_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2, moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=48, moe_latent_size=32, routed_scaling_factor=1.5)
        return tf.NemotronHForCausalLM(config)
    if family == "granite_hybrid":
        config = tf.GraniteMoeHybridConfig(
            **_COMMON, **_MAMBA2, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
            intermediate_size=32, shared_intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
            embedding_multiplier=2.0, residual_multiplier=0.7, attention_multiplier=0.2, logits_scaling=1.5)
        return tf.GraniteMoeHybridForCausalLM(config)
    if family == "bamba":
        config = tf.BambaConfig(**_COMMON, **_MAMBA2, num_hidden_layers=3, attn_layer_indices=[1],
                                intermediate_size=96)
        return tf.BambaForCausalLM(config)
    if family == "bamba_one_group":  # one group of B/C for all heads: fewer groups than tensor-parallel ranks
        config = tf.BambaConfig(**_COMMON, **dict(_MAMBA2, mamba_n_groups=1), num_hidden_layers=3,
                                attn_layer_indices=[1], intermediate_size=96)
        return tf.BambaForCausalLM(config)
    if family == "falcon_h1":
        config = tf.FalconH1Config(
            **_COMMON, **_MAMBA2, head_dim=16, num_hidden_layers=2, intermediate_size=96, mamba_d_ssm=128,
            mamba_rms_norm=True, embedding_multiplier=1.5, lm_head_multiplier=0.8, mlp_multipliers=[1.3, 0.6],
            key_multiplier=0.9, attention_in_multiplier=1.2, attention_out_multiplier=0.7,
            ssm_multipliers=[0.5, 1.5, 0.7, 1.3, 2.0], ssm_in_multiplier=1.1, ssm_out_multiplier=0.8)
        return tf.FalconH1ForCausalLM(config)
    if family == "lfm2":
        config = tf.Lfm2Config(**_COMMON, num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "conv"],
                               intermediate_size=96, block_multiple_of=32, conv_bias=True)
        return tf.Lfm2ForCausalLM(config)
    if family == "qwen3_next":
        config = tf.Qwen3NextConfig(**_COMMON, **_GATED_DELTA, num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[2])
        return tf.Qwen3NextForCausalLM(config)
    if family == "qwen3_5":
        return tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**_COMMON, **_GATED_DELTA))
    if family == "qwen3_5_moe_multimodal":  # as Qwen3.5-MoE is released: the language model inside a multimodal one
        text = dict(_COMMON, **_GATED_DELTA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    shared_expert_intermediate_size=48)
        del text["intermediate_size"]
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
        # (its head tied to the embeddings by the multimodal config's flag, the text config's saying not)
        config = tf.Qwen3_5MoeConfig(text_config=text, vision_config=vision, image_token_id=208, video_token_id=209,
                                     vision_start_token_id=206, vision_end_token_id=207, tie_word_embeddings=True)
        return tf.Qwen3_5MoeForConditionalGeneration(config)
    raise ValueError(family)


def load_reference(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def reference_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens])).logits[0].float()


def check_tokens(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """Every generated token is an argmax (up to ties) of transformers' logits."""
    logits = reference_logits(model, prompt + generated)
    for i, token in enumerate(generated):
        row = logits[len(prompt) - 1 + i]
        assert row[token] >= row.max() - TIE, (
            f"token {i} ({token}) is not an argmax: {row[token].item()} vs max {row.max().item()}")
    return logits


def record_logits(engine) -> list:
    """Spy on the engine's steps: (sequence id, position, logits row) for every sampled row."""
    records = []
    apply = engine._apply

    def spying(steps, logits):
        completing = [s for s in steps if s.completes]
        for s, row in zip(completing, logits):
            records.append((s.seq.seq_id, s.start + s.count - 1, row.detach().float().cpu().clone()))
        return apply(steps, logits)

    engine._apply = spying
    return records


def model_dir(tmp_factory, family: str, **kw) -> str:
    path = str(tmp_factory.mktemp(f"{family}-model"))
    return build(family, os.path.join(path, "model"), **kw)
