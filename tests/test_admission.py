"""Request admission (serving/admission.py): every reason a request cannot run, found before the model sees it."""

import numpy as np
import pytest
import torch

from quantmla.errors import QuantMLAError
from quantmla.serving.admission import as_requests, eos_ids, is_token_id, refusal
from quantmla.serving.scheduler import Request, SamplingParams

LIMITS = dict(vocab=100, max_positions=64, width=48, capacity=1000)


def _req(prompt, n=4, rid="r"):
    return Request(rid, prompt, SamplingParams(max_new_tokens=n))


@pytest.mark.parametrize("prompt,n,needle", [
    ([], 4, "the prompt is empty"),
    (["a", "b"], 4, "must be token ids"),
    ([1.0, 2.0], 4, "must be token ids"),
    ([True, 2], 4, "must be token ids"),
    ([1, 2], 2.5, "whole number, at least 1, got 2.5"),
    ([1, 2], 0, "whole number, at least 1, got 0"),
    ([1, 2], None, "whole number, at least 1, got None"),
    ([1, -3], 4, "this prompt has -3"),
    ([1, 100], 4, "must lie in [0, 100); this prompt has 100"),
    ([1] * 40, 26, "needs 65 positions but the model has max_position_embeddings 64"),
    ([1] * 40, 10, "needs 49 cached tokens but the engine was built for sequences of at most 48"),
])
def test_each_refusal_names_the_request_and_the_fix(prompt, n, needle):
    why = refusal(_req(prompt, n, rid="job-7"), **LIMITS)
    assert why is not None and needle in why and "'job-7'" in why


def test_requests_that_can_run_pass():
    assert refusal(_req([1, 2, 3], 4), **LIMITS) is None
    assert refusal(_req([0, 99] * 20, 9), **LIMITS) is None  # 49 positions: at most the width
    assert refusal(_req([1] * 40, 10), **{**LIMITS, "capacity": 48}) is None  # past the budget: the scheduler's
    assert refusal(_req([1] * 40, 30), **{**LIMITS, "max_positions": None, "width": 100}) is None
    assert refusal(_req([np.int64(3), torch.tensor(5)], 2), **LIMITS) is None


def test_token_ids_eos_and_request_lists():
    assert is_token_id(3) and is_token_id(np.int32(3)) and is_token_id(torch.tensor([7]))
    assert not any(is_token_id(t) for t in (True, 3.0, "3", torch.tensor([1, 2]), torch.tensor(1.0)))
    default = {2}
    assert eos_ids(_req([1]), default) is default
    for e, want in ((5, {5}), ([5, 6], {5, 6}), (torch.tensor([[5], [6]]), {5, 6})):
        r = Request("r", [1], SamplingParams(eos_token_id=e))
        assert eos_ids(r, default) == want
    reqs = as_requests(iter([[1, 2], [3]]), SamplingParams(max_new_tokens=2))
    assert [(r.request_id, r.prompt, r.params.max_new_tokens) for r in reqs] == [(0, [1, 2], 2), (1, [3], 2)]
    with pytest.raises(QuantMLAError, match="params are for token-id lists"):
        as_requests([_req([1])], SamplingParams())
