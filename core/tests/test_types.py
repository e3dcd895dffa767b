import numpy as np
import pytest

from plait.serde import from_json, to_json
from plait.types import (
    Datum,
    ImageBlock,
    ModelInput,
    SampledSequence,
    SamplingParams,
    TensorData,
    TextBlock,
    ToolOutput,
)


def test_model_input_round_trip():
    mi = ModelInput.from_ints([1, 2, 3]).append_ints([4])
    assert mi.to_ints() == [1, 2, 3, 4]
    assert mi.length == 4
    assert ModelInput.empty().length == 0


def test_tensor_data_keeps_dtype_and_shape():
    td = TensorData.from_numpy(np.arange(6).reshape(2, 3))
    assert td.dtype == "int64" and td.shape == (2, 3)
    assert td.to_numpy().tolist() == [[0, 1, 2], [3, 4, 5]]
    assert from_json(TensorData, to_json(td)) == td
    assert TensorData.from_numpy(np.ones(2, dtype=np.float64)).dtype == "float32"


def test_datum_coerces_lists_with_tinker_default_dtypes():
    d = Datum(ModelInput.from_ints([5, 6, 7]), {"target_tokens": [6, 7, 8], "weights": [0, 1, 1]})
    assert d.loss_fn_inputs["target_tokens"].dtype == "int64"
    assert d.loss_fn_inputs["weights"].dtype == "float32"


def test_datum_rejects_misaligned_inputs():
    with pytest.raises(ValueError, match=r"expected \(3,\)"):
        Datum(ModelInput.from_ints([5, 6, 7]), {"target_tokens": [6, 7]})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampled_sequence_checks_lengths_and_versions():
    seq = SampledSequence([1, 2], [-0.1, -0.2], "stop", weight_version=3)
    assert seq.versions() == (3, 3)
    with pytest.raises(ValueError, match="logprobs"):
        SampledSequence([1, 2], [-0.1], "stop")
    with pytest.raises(ValueError, match="token_versions"):
        SampledSequence([1, 2], [-0.1, -0.2], "stop", token_versions=[1])


def test_tool_output_json_round_trip_with_block_union():
    out = ToolOutput(
        blocks=[TextBlock("hi"), ImageBlock("aGk=", "image/png")],
        reward=0.5,
        finished=True,
        metadata={"k": 1},
    )
    data = to_json(out)
    assert data["blocks"][0] == {"text": "hi", "type": "text", "detail": None}
    assert from_json(ToolOutput, data) == out
    assert out.text == "hi"


def test_compact_ids_take_the_narrowest_dtype_and_round_trip():
    for top, dtype in ((255, "uint8"), (256, "uint16"), (70_000, "int32")):
        ids = np.array([[0, top], [1, 2]])
        tensor = TensorData.compact(ids)
        assert (tensor.dtype, tensor.shape, tensor.data.dtype.name) == (dtype, (2, 2), dtype)
        assert from_json(TensorData, to_json(tensor)) == tensor
    datum = Datum(
        ModelInput.from_ints([1, 2]),
        {"target_tokens": [2, 3], "routed_experts": np.ones((2, 3, 2))},
    )
    assert datum.loss_fn_inputs["routed_experts"].dtype == "uint8"
