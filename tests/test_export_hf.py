"""``fibattn export --format hf``: the drop-in loader restores the sparse attention with the FibLM's logits;
plain transformers refuses the folder without trust_remote_code; AutoTokenizer gives fibattn's ids. (The
remote code itself: test_export_hf_remote.py.)"""
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import fibattn  # noqa: E402
from fibattn.cli import main  # noqa: E402
from fibattn.interop import hf_llama as H  # noqa: E402
from fibattn.model.rope import interleaved_to_halves as _interleaved_to_halves  # noqa: E402
from fibattn.trainer.trainer import train  # noqa: E402
from run_helpers import micro_config  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_data):
    root = tmp_path_factory.mktemp("hf")
    cfg = micro_config(root / "run", tiny_data, n_layers=2, steps=3, batch_tokens=64, micro_batch=2,
                       results_db="off", eval_tokens=64)
    cfg.model.reach = "train"
    train(cfg)
    return root / "run"


def test_rope_permutation_keeps_scores():
    q, k = torch.randn(8, 3), torch.randn(8, 3)            # one head, Dh 8 (rows), 3 inputs
    wq, wk = _interleaved_to_halves(q, 1, 8), _interleaved_to_halves(k, 1, 8)
    x = torch.randn(5, 3)
    torch.testing.assert_close((x @ wq.T) @ (x @ wk.T).T, (x @ q.T) @ (x @ k.T).T)


def test_export_hf_round_trip(run, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(transformers.dynamic_module_utils, "TIME_OUT_REMOTE_CODE", 0)   # refuse, never prompt
    out = tmp_path / "hf"
    assert main(["export", str(run), str(out), "--format", "hf"]) == 0
    assert "hf_llama.from_pretrained" in capsys.readouterr().out
    fib = fibattn.from_pretrained(run)
    text = "ROMEO: what light é"
    x = torch.tensor([fib.tokenizer.encode(text)] * 2)
    x = torch.cat([x, x], 1)                                          # 2 × 48 tokens: past the window and T
    sparse = H.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(sparse(x).logits, fib(x), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="trust_remote_code"):     # never a silent dense model
        transformers.AutoModelForCausalLM.from_pretrained(out)
    tok = transformers.AutoTokenizer.from_pretrained(out)     # refused remote config: the tokenizer still loads
    assert tok(text)["input_ids"] == fib.tokenizer.encode(text) and tok.decode(tok(text)["input_ids"]) == text
    assert tok.eos_token_id == fib.tokenizer.eos_id
    capsys.readouterr()
    assert main(["export", str(run), str(out), "--format", "hf"]) == 2          # not empty: refused
    assert main(["export", str(run), str(tmp_path / "x"), "--format", "hf", "--force"]) == 2


def test_export_hf_has_a_model_card(run, tmp_path):
    from fibattn.interop.hf_export import export_hf
    out = export_hf(run, tmp_path / "hf")
    card = (out / "README.md").read_text()
    assert "hf_llama.from_pretrained" in card and "parameters" in card


@pytest.mark.parametrize("tied", [True, False])
def test_llama_names_round_trip(tied):
    from fibattn.config import ModelConfig
    from fibattn.model.lm import FibLM
    from fibattn.model.llama_names import from_llama, to_llama
    m = ModelConfig(vocab_size=40, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=8, window=2, base_k=4,
                    tie_embeddings=tied)
    state = FibLM(m).state_dict()
    kw = dict(heads=4, kv_heads=2, head_dim=4, tied=tied)
    llama = to_llama(state, **kw)
    assert len(llama) == len(state) + tied and "lm_head.weight" in llama
    back = from_llama(llama, **kw)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
