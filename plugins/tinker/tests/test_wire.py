"""The wire schema and conversions against the tinker SDK's own: the generated .proto matches
the installed SDK's messages field by field, and what the SDK encodes decodes to plait's types
(and back)."""

from __future__ import annotations

import numpy as np
import pytest

from plait.api import ForwardBackwardOutput, SampledSequence, SampleResponse, TensorData
from plait_tinker import tinker_wire_pb2 as pb, wire

tinker = pytest.importorskip("tinker")


def _shape(descriptor) -> dict:
    return {
        message.name: {
            field.name: (
                field.number,
                field.type,
                field.is_repeated,
                field.has_presence,
                field.containing_oneof.name if field.containing_oneof else None,
                (field.message_type or field.enum_type or field).name,
            )
            for field in message.fields
        }
        for message in descriptor.message_types_by_name.values()
    } | {
        enum.name: {v.name: v.number for v in enum.values}
        for enum in descriptor.enum_types_by_name.values()
    }


def test_the_schema_is_the_sdks() -> None:
    from tinker.proto import tinker_public_pb2 as sdk

    assert _shape(pb.DESCRIPTOR) == _shape(sdk.DESCRIPTOR)


def _sdk_request(data, loss_fn="cross_entropy", config=None) -> bytes:
    from tinker.proto import request_conv

    request = tinker.types.ForwardBackwardRequest(
        forward_backward_input=tinker.types.ForwardBackwardInput(
            data=data, loss_fn=loss_fn, loss_fn_config=config
        ),
        model_id="s:train:0",
        seq_id=3,
    )
    return request_conv.forward_backward_request_to_proto(request).SerializeToString()


def test_a_forward_backward_request_from_the_sdk_decodes() -> None:
    import torch

    types = tinker.types
    dense = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [0.0, 1.0, 1.0]},
    )
    # 2-D inputs the SDK sends as sparse CSR when that is smaller
    targets = torch.zeros(3, 4, dtype=torch.int64)
    targets[1, 2], targets[2, 0] = 9, 11
    sparse = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": types.TensorData.from_torch(targets)},
    )
    call = wire.read_forward_backward(
        _sdk_request([dense, sparse], "ppo", {"clip_low_threshold": 0.8})
    )
    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == (
        "s:train:0",
        3,
        "ppo",
        False,
    )
    assert call.loss_fn_config == {"clip_low_threshold": pytest.approx(0.8)}
    assert call.data[0].model_input.to_ints() == [5, 6, 7]
    assert call.data[0].loss_fn_inputs["weights"].tolist() == [0.0, 1.0, 1.0]
    assert call.data[0].loss_fn_inputs["target_tokens"].dtype == "int64"
    np.testing.assert_array_equal(
        call.data[1].loss_fn_inputs["target_tokens"].to_numpy(), targets.numpy()
    )


def test_results_decode_in_the_sdk() -> None:
    from tinker.proto import response_conv

    output = ForwardBackwardOutput(
        "cross_entropy",
        [
            {"logprobs": TensorData.from_numpy(np.array([-1.0, -2.0], dtype=np.float32))},
            {"logprobs": TensorData.from_numpy(np.array([-0.5], dtype=np.float32))},
        ],
        {"loss:sum": 3.5, "entropy:mean": 1.25, "routing_agreement": 0.5, "a:b:mean": 1.0},
    )
    decoded = response_conv.deserialize_forward_backward_output(wire.write_forward_backward(output))
    assert [o["logprobs"].tolist() for o in decoded.loss_fn_outputs] == [[-1.0, -2.0], [-0.5]]
    assert decoded.metrics == {
        "loss:sum": 3.5,
        "entropy:mean": 1.25,
        "routing_agreement:mean": 0.5,
        "a_b_mean:mean": 1.0,
    }
    sample = SampleResponse(
        [SampledSequence([4, 5], [-0.25, -0.5], "length"), SampledSequence([7], [-1.0], "stop")]
    )
    decoded_sample = response_conv.deserialize_sample_response(
        wire.write_sample(sample, [None, -0.5, -2.0])
    )
    assert [list(s.tokens) for s in decoded_sample.sequences] == [[4, 5], [7]]
    assert [s.stop_reason for s in decoded_sample.sequences] == ["length", "stop"]
    assert decoded_sample.sequences[0].logprobs == [-0.25, -0.5]
    assert decoded_sample.prompt_logprobs == [None, -0.5, -2.0]


def test_unreadable_requests_are_wire_errors_that_say_what() -> None:
    types = tinker.types
    with pytest.raises(wire.WireError, match="not a ForwardBackwardRequest"):
        wire.read_forward_backward(b"\xff\xff\xff")
    with pytest.raises(wire.WireError, match=r"data\[0\].*shape"):
        wire.read_forward_backward(
            _sdk_request(
                [
                    types.Datum(
                        model_input=types.ModelInput.from_ints([1, 2, 3]),
                        loss_fn_inputs={"target_tokens": [1, 2]},
                    )
                ]
            )
        )
    with pytest.raises(wire.WireError, match="prompt: the prompt is empty"):
        wire.model_input({"chunks": []})
    with pytest.raises(wire.WireError, match="encoded_text"):
        wire.model_input({"chunks": [{"type": "image", "data": ""}]})
    with pytest.raises(wire.WireError, match="temperature"):
        wire.sampling_params({"temperature": -1})
