"""Hugging Face models built offline from configs: encoder, causal LM generate, diffusion pipeline."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_tweak.torch as tt
from torch_tweak.torch.backend import TorchEagerBackend

transformers = pytest.importorskip("transformers")


def eager() -> tt.OneBackendStrategy:
    return tt.OneBackendStrategy(TorchEagerBackend())


def test_bert_encoder_through_inspect_wrap_tune_keeps_model_output_type():
    from hf_models import bert_dataset, tiny_bert

    model = tiny_bert()
    data = bert_dataset()
    batch = {"input_ids": torch.randint(1, 100, (3, 8)), "attention_mask": torch.ones(3, 8, dtype=torch.long)}
    with torch.no_grad():
        expected = model(**batch)
    report = tt.inspect(model, data, number_of_iterations=2, warmup_iterations=1)
    (root,) = report.get_modules()
    assert root.name == "" and root.calls == 2
    wrapped = tt.wrap(model, [root], strategy=eager())
    tt.tune(wrapped, data, batch_sizes=[1, 2])
    (spec,) = wrapped.graph_specs
    ids = next(t for t in spec.inputs if t.name == "kwargs_input_ids")
    assert ids.shape == ("batch0", "dim1")
    with torch.no_grad():
        actual = wrapped(**batch)
    assert type(actual) is type(expected)
    torch.testing.assert_close(actual.last_hidden_state, expected.last_hidden_state)


def test_bert_encoder_with_openvino_keeps_output_type():
    pytest.importorskip("openvino")
    from hf_models import bert_dataset, tiny_bert

    from torch_tweak.torch.backend import OpenVINOBackend, OpenVINOBackendConfig

    model = tiny_bert()
    batch = {"input_ids": torch.randint(1, 100, (2, 10)), "attention_mask": torch.ones(2, 10, dtype=torch.long)}
    with torch.no_grad():
        expected = model(**batch)
    strategy = tt.OneBackendStrategy(OpenVINOBackend(OpenVINOBackendConfig(inference_precision="f32")))
    wrapped = tt.Module(model, name="bert", strategy=strategy)
    report = tt.tune(wrapped, bert_dataset(), batch_sizes=[1, 2], ignore_failing_modules=False)
    assert report.modules[0].graphs[0].candidates[0].status == "chosen"
    with torch.no_grad():
        actual = wrapped(**batch)
    assert type(actual) is type(expected)
    torch.testing.assert_close(actual.pooler_output, expected.pooler_output, atol=1e-4, rtol=1e-4)


def test_llm_generate_prefill_and_decode_graphs_give_same_tokens():
    from hf_models import tiny_llama

    model = tiny_llama()
    prompt = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model.generate(prompt, max_new_tokens=6, do_sample=False)
    prefill, decode = eager(), tt.OneBackendStrategy(TorchEagerBackend())
    wrapped = tt.Module(model, name="llm", strategies=[prefill, decode])

    def generate(input_ids):
        return wrapped.generate(input_ids, max_new_tokens=4, do_sample=False)

    report = tt.tune(generate, [torch.randint(0, 100, (5,)) for _ in range(2)], batch_sizes=[1, 2])
    assert [g.name for g in report.modules[0].graphs] == ["0-prefill", "1-decode"]
    assert [spec.phase for spec in wrapped.graph_specs] == ["prefill", "decode"]
    with torch.no_grad():
        actual = wrapped.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("runtime", ["onnxruntime", "openvino"])
def test_llm_tuned_on_left_padded_batches_keeps_eager_logits(runtime):
    """Batched generation pads prompts on the left, so under the causal mask a pad position's query sees no key,
    and eager's attention returns zeros there. ONNX Runtime (opset-20 export) and OpenVINO (NaN) used to differ on
    those rows, and their candidates failed the check on such a model."""
    pytest.importorskip(runtime)
    from hf_models import tiny_llama

    from torch_tweak.torch.backend import ONNXRuntimeBackend, OpenVINOBackend, OpenVINOBackendConfig

    backend = ONNXRuntimeBackend() if runtime == "onnxruntime" else OpenVINOBackend(
        OpenVINOBackendConfig(inference_precision="f32"))
    generator = torch.Generator().manual_seed(5)

    def prompt(pads: int) -> dict[str, torch.Tensor]:
        mask = torch.ones(10, dtype=torch.long)
        mask[:pads] = 0
        return {"input_ids": torch.randint(1, 100, (10,), generator=generator), "attention_mask": mask}

    batch = [prompt(p) for p in (4, 0, 7)]
    ids, mask = (torch.stack([b[k] for b in batch]) for k in ("input_ids", "attention_mask"))
    model = tiny_llama()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    wrapped = tt.Module(model, name=f"padded_{runtime}", strategy=tt.OneBackendStrategy(backend))

    def logits(input_ids, attention_mask):
        return wrapped(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    report = tt.tune(logits, [prompt(p) for p in (0, 3, 5, 1)], batch_sizes=[1, 2], ignore_failing_modules=False)
    assert all(g.candidates[0].status == "chosen" for g in report.modules[0].graphs)
    with torch.no_grad():
        actual = logits(ids, mask)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_stable_diffusion_pipeline_inspect_wrap_tune():
    pytest.importorskip("diffusers")
    from hf_models import run_sd, tiny_stable_diffusion

    pipe = tiny_stable_diffusion()
    expected = run_sd(pipe, "a cat")
    report = tt.inspect(pipe, ["a cat", "a dog"], inference_function=lambda p: run_sd(pipe, p),
                        number_of_iterations=2, warmup_iterations=1)
    names = [m.name for m in report.get_modules()]
    assert "unet" in names and "text_encoder" in names
    tt.wrap(pipe, report.get_modules(), strategy=eager())
    assert isinstance(pipe.unet, tt.Module) and isinstance(pipe.text_encoder, tt.Module)
    tuned = tt.tune(lambda p: run_sd(pipe, p), ["a cat", "a dog"], batch_sizes=[1, 2])
    assert all(m.status == "tuned" for m in tuned.modules)
    unet_input = pipe.unet.graph_specs[0].inputs[0]
    assert unet_input.shape[0] == "batch0" and unet_input.batch_multipliers == {0: 2}  # classifier-free guidance
    np.testing.assert_allclose(run_sd(pipe, "a cat"), expected, atol=1e-5)


def test_static_cache_is_traversed_as_tensors():
    from hf_models import tiny_llama

    model = tiny_llama()
    prompt = torch.randint(0, 100, (1, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = model.generate(prompt, max_new_tokens=3, do_sample=False, cache_implementation="static")
    wrapped = tt.Module(model, name="static_llm", strategy=eager())

    def generate(input_ids):
        return wrapped.generate(input_ids, max_new_tokens=3, do_sample=False, cache_implementation="static")

    tt.tune(generate, [torch.randint(0, 100, (5,))], batch_sizes=[1])
    decode = next(spec for spec in wrapped.graph_specs if spec.phase == "decode")
    cache_tensors = [t for t in decode.inputs if t.locator.startswith("kwargs['cache'].layers")]
    assert cache_tensors and all(t.rank == 4 for t in cache_tensors)
    with torch.no_grad():
        actual = wrapped.generate(prompt, max_new_tokens=3, do_sample=False, cache_implementation="static")
    assert torch.equal(actual, expected)


def test_the_tiny_pipeline_leaves_no_folder_behind(tmp_path, monkeypatch):
    pytest.importorskip("diffusers")
    import tempfile

    from hf_models import tiny_stable_diffusion

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    pipe = tiny_stable_diffusion()
    assert list(tmp_path.iterdir()) == []
    ids = pipe.tokenizer("a cat").input_ids  # the tokenizer read its files when built and works without them
    assert ids[0] == 0 and ids[-1] == 1 and len(ids) > 2
