"""GGUF checkpoints: Engine("x.gguf") converts once into the cache (through
transformers' GGUF path), serves the same greedy tokens as transformers
loading the same file, reuses the converted folder, and refuses what it
cannot serve with a clear ValueError and nothing left in the cache."""

from __future__ import annotations

import os

import pytest
import torch

from gguf_files import build_model, write_gguf
from hybridkv import Engine, SamplingParams
from hybridkv.modeling import gguf as gguf_loader

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [[2] + [(7 * i + 3 * j) % 290 + 4 for j in range(n)] for i, n in enumerate((40, 9, 23))]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("HYBRIDKV_CACHE", str(root))
    return root


def gguf_file(tmp_path, family, tensor_type="F32", **kw):
    folder = tmp_path / f"{family}-{tensor_type}"
    folder.mkdir()
    return write_gguf(build_model(family), str(folder / f"tiny-{family}.gguf"), family, tensor_type, **kw)


def transformers_greedy(path, prompts):
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    out = []
    for ids in prompts:
        with torch.inference_mode():
            tokens = model.generate(torch.tensor([ids]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                                    attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        out.append(tokens[0, len(ids):].tolist())
    return out


def converted_folders(cache):
    root = cache / "gguf"
    return sorted(os.listdir(root)) if root.exists() else []


@pytest.mark.parametrize("family,tensor_type", [("gemma3", "F32"), ("gemma3", "Q8_0"), ("gemma2", "F32"),
                                                        ("llama", "F16")])
def test_engine_serves_a_gguf_file_like_transformers(tmp_path, cache, family, tensor_type):
    path = gguf_file(tmp_path, family, tensor_type)
    engine = Engine(path, kv_cache_memory="16MiB", block_size=4, progress=False)
    outs = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == transformers_greedy(path, PROMPTS)
    assert engine.tokenizer is not None and engine.tokenizer.bos_token_id == 2
    (folder,) = converted_folders(cache)
    assert os.path.isfile(cache / "gguf" / folder / "model.safetensors")


@pytest.mark.parametrize("add_bos", [True, False])
@pytest.mark.parametrize("reader", ["as transformers reads it", "read without its BOS"])
def test_the_tokenizer_starts_a_text_with_bos_as_the_file_says(tmp_path, cache, monkeypatch, add_bos, reader):
    # Some transformers releases (5.19) read a GGUF tokenizer without the
    # BOS its file asks for ("read without its BOS" plays one): the
    # converted folder must follow the file's tokenizer.ggml.add_bos_token.
    if reader == "read without its BOS":
        import transformers
        from tokenizers import processors

        tokenizer_class = transformers.GemmaTokenizer
        read = tokenizer_class.from_pretrained.__func__

        def without_bos(cls, *args, **kwargs):
            tokenizer = read(cls, *args, **kwargs)
            if kwargs.get("gguf_file"):
                tokenizer._tokenizer.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1")
            return tokenizer

        monkeypatch.setattr(tokenizer_class, "from_pretrained", classmethod(without_bos))
    path = gguf_file(tmp_path, "gemma3", add_bos=add_bos)
    engine = Engine(path, kv_cache_memory="16MiB", block_size=4, progress=False)
    ids = engine.tokenizer.encode("a b")
    assert (ids[0] == engine.tokenizer.bos_token_id == 2) == add_bos
    assert ids.count(2) == int(add_bos)


def test_second_load_reads_the_converted_folder(tmp_path, cache, monkeypatch):
    path = gguf_file(tmp_path, "gemma3")
    first = Engine(path, kv_cache_memory="16MiB", block_size=4, progress=False)

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf_loader, "_convert", no_conversion)
    second = Engine(os.path.dirname(path), kv_cache_memory="16MiB", block_size=4, progress=False)  # the folder
    assert second.model_dir == first.model_dir
    a = first.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    b = second.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b


def test_changed_file_content_is_converted_again(tmp_path, cache):
    path = gguf_file(tmp_path, "gemma3")
    Engine(path, kv_cache_memory="16MiB", block_size=4, progress=False)
    write_gguf(build_model("gemma3", seed=1), path, "gemma3")
    Engine(path, kv_cache_memory="16MiB", block_size=4, progress=False)
    assert len(converted_folders(cache)) == 2  # keyed by content, not by name


def test_unsupported_architecture_is_refused_at_once(tmp_path, cache):
    import gguf

    path = str(tmp_path / "other.gguf")
    writer = gguf.GGUFWriter(path, "qwen2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"architecture 'qwen2' is not supported; supported: gemma3, gemma2, llama"):
        Engine(path, progress=False)
    assert converted_folders(cache) == []


def test_unsupported_tensor_type_is_a_clear_error_and_leaves_nothing(tmp_path, cache):
    path = gguf_file(tmp_path, "gemma3", "Q8_1")
    with pytest.raises(ValueError, match=r"Q8_1.*hybridkv reads GGUF files of the types F32, F16, BF16"):
        Engine(path, progress=False)
    assert converted_folders(cache) == []


def test_truncated_file_is_a_clear_error_and_leaves_nothing(tmp_path, cache):
    full = gguf_file(tmp_path, "gemma3")
    size = os.path.getsize(full)
    os.truncate(full, size // 2)
    with pytest.raises(ValueError, match="truncated or damaged"):
        Engine(full, progress=False)
    assert converted_folders(cache) == []
    os.truncate(full, 40)  # inside the header
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        Engine(full, progress=False)


def test_not_a_gguf_file(tmp_path):
    junk = tmp_path / "weights.gguf"
    junk.write_bytes(os.urandom(1000))
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        Engine(str(junk), progress=False)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"0" * 10)
    with pytest.raises(ValueError, match="not a .gguf checkpoint"):
        Engine(str(other), progress=False)


def test_folder_with_two_gguf_files_asks_for_one(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    (tmp_path / "b.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="holds 2 .gguf files"):
        Engine(str(tmp_path), progress=False)
