"""Generation with a key/value cache: the cached step-by-step logits equal a full forward of the
whole sequence, greedy decoding equals argmax over full forwards, and the CLI generates text."""

import torch

from hpservice.models.generate import KVCache, generate, next_logits
from hpservice.models.llama import Llama, LlamaConfig


def _model():
    torch.manual_seed(0)
    return Llama(LlamaConfig(dim=48, n_layers=2, n_heads=6, n_kv_heads=2, vocab_size=64, max_seq_len=40)).eval()


def test_cached_logits_equal_a_full_forward():
    model = _model()
    tokens = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(1))
    cache = KVCache(len(model.layers))
    parts = [next_logits(model, tokens[:, :7], cache)]  # a prefill, then one token at a time
    for i in range(7, 20):
        parts.append(next_logits(model, tokens[:, i : i + 1], cache))
    with torch.no_grad():
        full = model(tokens)
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=1e-5)


def test_greedy_equals_argmax_over_full_forwards_and_top_k_one_is_greedy():
    model = _model()
    prompt = [3, 14, 15, 9, 26]
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert generate(model, prompt, 12) == seq[len(prompt) :]
    assert generate(model, prompt, 12, temperature=0.7, top_k=1, seed=5) == seq[len(prompt) :]
    sampled = [generate(model, prompt, 12, temperature=1.0, seed=s) for s in range(3)]
    assert sampled[0] == generate(model, prompt, 12, temperature=1.0, seed=0)  # seeded: reproducible
    assert len({tuple(s) for s in sampled}) > 1


def test_cli_generates_from_a_checkpoint(tmp_path, capsys):
    import json

    from safetensors.torch import save_file

    from hpservice.cli import main
    from hpservice.models.hf import _to_hf_layout, hf_config, hf_name

    model = Llama(LlamaConfig(vocab_size=256, max_seq_len=64))  # a byte-level model, HF format on disk
    tensors = {
        hf_name(n): _to_hf_layout(n, p.detach(), model.cfg.head_dim).contiguous() for n, p in model.named_parameters()
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf_config(model.cfg)))
    assert main(["generate", str(tmp_path), "--prompt", "hello", "--max-new-tokens", "5"]) == 0
    out = capsys.readouterr().out
    expected = bytes(generate(model, list(b"hello"), 5)).decode("utf-8", errors="replace")
    assert out.startswith("hello") and out.rstrip("\n") == "hello" + expected
