"""Small random models to run everything without a download: one of every
family the engine runs (Gemma-3, Jamba, Nemotron-H, Granite-4.0-H, Bamba,
Falcon-H1, LFM2, gpt-oss) with seeded weights and a byte-level BPE tokenizer
trained on a built-in corpus, saved as ordinary Hugging Face folders (built
with transformers' own classes) in a cache folder.

    path = tiny_model_dir("tiny-gemma3")   # builds it on first use
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile

from .files import cache_root

VERSION = 2

_WORDS = """the of and to in is that for it as was with be by on not he this are or his from at which but have
an they you were her she there been one all we their if has will would what so can more about when up out
who them some could him into time only new other then two may first these also any like now over such our
man me even most made after well way many before must through back years where much your down good should
because each just those people how too little state world very still own see men work long here get both
between life being under never day same another know while last might us great old year off come since
against go came right used take three himself few house use during without again place around however home
small found thought went say part once high general upon school every does got united left number course war
until always away something fact though water less public put think almost hand enough far took head yet
government system better set told nothing night end why called didn find look asked later point knew city next
program business give group toward young days let room president side social given present several order
national possible rather second face per among form important often things looked early white case john become
large big need four within felt along children saw best church ever least power development light thing seemed
family interest want members mind country area others done turned although open god service certain kind problem
began different door thus help sense means whole matter perhaps itself york times law human line above name
example action company hands local show whether five history gave today either act feet across taken past quite
anything seen having death week experience body word half really field am car words already themselves information
tell together college shall money period held keep sure real probably free seems political cannot behind miss""".split()

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
    "{{ message['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>assistant\n{% endif %}")

# name -> (family, sizes); "tiny" for tests and the demo, "small" for benchmarks
MODELS = {
    "tiny-gemma3": ("gemma3", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, sliding_window=32)),
    "tiny-jamba": ("jamba", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, attn_layer_period=4, attn_layer_offset=2, num_experts=4,
                                 mamba_d_state=16, mamba_dt_rank=8)),
    # head_dim 64, what vLLM's CPU attention runs: the vLLM connector's tests and benchmark.
    "vllm-tiny-gemma3": ("gemma3", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=6,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=64, sliding_window=32)),
    "tiny-gpt-oss": ("gpt_oss", dict(hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=16, sliding_window=32, num_local_experts=4,
                                     num_experts_per_tok=2)),
    "small-gemma3": ("gemma3", dict(hidden_size=192, intermediate_size=576, num_hidden_layers=12,
                                    num_attention_heads=6, num_key_value_heads=2, head_dim=32, sliding_window=128)),
    "small-jamba": ("jamba", dict(hidden_size=192, intermediate_size=576, num_hidden_layers=8, num_attention_heads=6,
                                  num_key_value_heads=2, attn_layer_period=4, attn_layer_offset=2, num_experts=4,
                                  mamba_d_state=16, mamba_dt_rank=12)),
    # The Mamba-2 hybrids (8 heads of 16 channels, state 16, conv 4) and LFM2's short convolutions.
    "tiny-nemotron-h": ("nemotron_h", dict(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        layers_block_type=["linear_attention", "mlp", "linear_attention", "full_attention", "linear_attention", "mlp"],
        mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4)),
    "tiny-granite-4h": ("granitemoehybrid", dict(
        hidden_size=64, intermediate_size=64, shared_intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, layer_types=["mamba", "mamba", "attention", "mamba"],
        num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=4.0)),
    "tiny-bamba": ("bamba", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, attn_layer_indices=[2], mamba_n_heads=8, mamba_d_head=16,
                                 mamba_d_state=16)),
    "tiny-falcon-h1": ("falcon_h1", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_d_ssm=128,
                                         mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16)),
    "tiny-lfm2": ("lfm2", dict(hidden_size=64, intermediate_size=192, num_hidden_layers=6, num_attention_heads=4,
                               num_key_value_heads=2, block_multiple_of=32,
                               layer_types=["conv", "conv", "full_attention", "conv", "conv", "full_attention"])),
}
# (transformers' config and model class of each family above but Gemma-3's and Jamba's)
FAMILY_CLASSES = {"nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM"),
                  "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM"),
                  "bamba": ("BambaConfig", "BambaForCausalLM"),
                  "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM"),
                  "lfm2": ("Lfm2Config", "Lfm2ForCausalLM")}


def sample_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def build_tokenizer(vocab_size: int = 1024, seed: int = 0):
    """A byte-level BPE (any text encodes, nothing is unknown) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    corpus = [sample_text(rng, rng.randint(5, 40)) + rng.choice([".", "?", "!", ","]) for _ in range(3000)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", additional_special_tokens=SPECIAL_TOKENS[3:])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(name: str, path: str, dtype: str = "float32", seed: int = 0, tokenizer=None) -> str:
    """Save a seeded random model `name` (see MODELS) with its tokenizer at `path`."""
    import torch
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, GptOssConfig, GptOssForCausalLM, JambaConfig,
                              JambaForCausalLM)

    from .layers.dtypes import TORCH_DTYPES

    if name not in MODELS:
        raise ValueError(f"unknown built-in model {name!r}; choose one of {sorted(MODELS)}")
    family, sizes = MODELS[name]
    tokenizer = tokenizer or build_tokenizer()
    ids = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id, max_position_embeddings=8192)
    torch.manual_seed(seed)
    if family == "gemma3":
        config = Gemma3TextConfig(**ids, **sizes, query_pre_attn_scalar=sizes["head_dim"],
                                  final_logit_softcapping=30.0, sliding_window_pattern=6)
        model = Gemma3ForCausalLM(config)
    elif family == "gpt_oss":
        # YaRN as the released configs (factor 32 over 4,096 tokens), scaled to this context.
        rope = dict(rope_type="yarn", rope_theta=150000.0, factor=2.0, original_max_position_embeddings=4096,
                    beta_fast=32.0, beta_slow=1.0, truncate=False)
        model = GptOssForCausalLM(GptOssConfig(**ids, **sizes, rope_parameters=rope))
    elif family == "jamba":
        config = JambaConfig(**ids, **sizes, expert_layer_period=2, expert_layer_offset=1, num_experts_per_tok=2,
                             mamba_d_conv=4, mamba_expand=2, tie_word_embeddings=False)
        model = JambaForCausalLM(config)
    else:
        import transformers

        config_class, model_class = (getattr(transformers, n) for n in FAMILY_CLASSES[family])
        model = model_class(config_class(**ids, **sizes))
    model = model.to(TORCH_DTYPES[dtype]).eval()
    tmp = tempfile.mkdtemp(prefix=".building-", dir=os.path.dirname(os.path.abspath(path)) or ".")
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)  # complete folders only, even if two builders race
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def tiny_model_dir(name: str = "tiny-gemma3", dtype: str = "float32") -> str:
    """The folder of a built-in model, built on first use."""
    path = os.path.join(cache_root(), "models", f"{name}-{dtype}-v{VERSION}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        build_model(name, path, dtype=dtype)
    return path
