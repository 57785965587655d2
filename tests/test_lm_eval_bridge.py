"""The lm-eval bridge: a local multiple-choice task scored through QuantMLACache, offline."""

from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")

from quantmla.cache.config import QuantCacheConfig  # noqa: E402
from quantmla.errors import QuantMLAError  # noqa: E402
from quantmla.model.tiny import tiny_model  # noqa: E402

DATA = Path(__file__).parent / "data" / "lm_eval_task" / "qmla_local.jsonl"
TASK = """task: qmla_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def _checkpoint(tmp_path: Path, quant: QuantCacheConfig | None = None) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([DATA.read_text()] * 3, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    model = tiny_model("deepseek_v3", vocab_size=512)
    if quant is not None:
        quant.attach(model)
    out = tmp_path / "ckpt"
    model.save_pretrained(out)
    fast.save_pretrained(out)
    return out


def _evaluate(lm, tmp_path):
    from lm_eval.tasks import TaskManager

    task_dir = tmp_path / "tasks"
    task_dir.mkdir(exist_ok=True)
    (task_dir / "qmla_local.yaml").write_text(TASK.format(data=DATA))
    res = lm_eval.simple_evaluate(model=lm, tasks=["qmla_local"], task_manager=TaskManager(include_path=str(task_dir)),
                                  limit=4, log_samples=True)
    return res


def test_lm_eval_scores_through_the_quantized_cache(tmp_path, monkeypatch):
    from quantmla.evaluation.lm_eval_bridge import QuantMLALM
    import quantmla.cache.hf_cache as hf_cache

    ckpt = _checkpoint(tmp_path)
    lm = QuantMLALM(pretrained=str(ckpt), content_bits=2, rope_bits=4, content_group=32, rope_group=16,
                    device="cpu", dtype="float32", batch_size=1)
    calls = []
    orig = hf_cache.QuantMLALayer.update
    monkeypatch.setattr(hf_cache.QuantMLALayer, "update", lambda self, *a, **k: calls.append(1) or orig(self, *a, **k))
    res = _evaluate(lm, tmp_path)
    acc = res["results"]["qmla_local"]["acc,none"]
    assert 0.0 <= acc <= 1.0
    assert calls, "the task's forwards must go through QuantMLACache"
    # the bridge's log-likelihoods equal a direct forward through the same cache
    sample = res["samples"]["qmla_local"][0]
    ll = sample["resps"][0][0][0]
    assert isinstance(ll, float) and ll < 0


def test_bits_that_disagree_with_the_checkpoint_are_an_error(tmp_path):
    from quantmla.evaluation.lm_eval_bridge import QuantMLALM

    ckpt = _checkpoint(tmp_path, QuantCacheConfig.of_bits(4, 4, 32, 16, method="quantmla"))
    lm = QuantMLALM(pretrained=str(ckpt), device="cpu", dtype="float32")  # takes the checkpoint's formats
    assert lm.quant.content.bits == 4
    with pytest.raises(QuantMLAError, match="calibrated .* for content INT4"):
        QuantMLALM(pretrained=str(ckpt), content_bits=2, rope_bits=4, content_group=32, rope_group=16,
                   device="cpu", dtype="float32")
