import grpc
import pytest

from pdserve.v1 import generation_pb2 as pb
from services.scheduler.tokenization import ModelFacts
from services.scheduler.validation import Limits, RequestError, validate

FACTS = ModelFacts("m", vocab_size=100, max_model_len=64)
LIMITS = Limits(max_prompt_tokens=32, max_new_tokens=40, default_max_tokens=8)


def req(ids: list[int], **sampling: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(**sampling))


def test_defaults_resolved_and_explicit_zero_temperature_kept() -> None:
    v = validate(req([1, 2, 3], temperature=0.0), FACTS, LIMITS, None)
    assert v.prompt_token_ids == [1, 2, 3] and v.max_tokens == 8 and v.sampling.max_tokens == 8
    assert v.sampling.HasField("temperature") and v.sampling.temperature == 0.0
    assert not v.sampling.HasField("top_p")


@pytest.mark.parametrize("request_, code, match", [
    (req([]), grpc.StatusCode.INVALID_ARGUMENT, "empty prompt"),
    (req([100]), grpc.StatusCode.INVALID_ARGUMENT, "outside the vocabulary"),
    (req([1] * 33), grpc.StatusCode.INVALID_ARGUMENT, "limit is 32"),
    (req([1] * 30, max_tokens=40), grpc.StatusCode.INVALID_ARGUMENT, "maximum length 64"),
    (req([1], max_tokens=41), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    (req([1], top_p=-0.1), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (pb.GenerateRequest(text="hi"), grpc.StatusCode.FAILED_PRECONDITION, "no tokenizer"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), model="x"), grpc.StatusCode.NOT_FOUND, "unknown model"),
])
def test_refusals_name_the_problem(request_: pb.GenerateRequest, code: grpc.StatusCode, match: str) -> None:
    with pytest.raises(RequestError, match=match) as e:
        validate(request_, FACTS, LIMITS, None)
    assert e.value.code == code


def test_the_request_is_not_modified() -> None:
    r = req([1, 2])
    validate(r, FACTS, LIMITS, None)
    assert not r.sampling.HasField("max_tokens")


def test_resumed_output_tokens_are_kept_and_checked() -> None:
    r = req([1, 2, 3], max_tokens=5)
    r.output_token_ids.extend([7, 8])
    assert validate(r, FACTS, LIMITS, None).output_token_ids == [7, 8]
    r.output_token_ids.extend([9, 10, 11])  # 5 of max_tokens 5: nothing left to generate
    with pytest.raises(RequestError, match="output_token_ids: 5 tokens"):
        validate(r, FACTS, LIMITS, None)
    bad = req([1], max_tokens=5)
    bad.output_token_ids.append(100)
    with pytest.raises(RequestError, match="output token id 100 outside"):
        validate(bad, FACTS, LIMITS, None)
