"""eval/: answers from a checkpoint equal the export's, prompts equal HF's processor inputs, VQA normalisation,
scores of a memorised and an untrained model, the training-curve figure, and AutoProcessor on an export."""

import io
import json
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

from .conftest import ROOT, not_here

sys.path.insert(0, str(ROOT))

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220), "yellow": (230, 210, 40),
           "white": (250, 250, 250), "black": (5, 5, 5), "purple": (140, 40, 160), "orange": (250, 140, 20)}


def _image(colour, size=(32, 32)):
    from PIL import Image

    return Image.new("RGB", size, COLOURS[colour])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny LLaVA and OneVision: HF dirs, Megatron checkpoints (TP2 torch_dist; bf16 for LLaVA), and exports."""
    from megatron_vlm.convert.to_hf import convert_megatron_to_hf
    from megatron_vlm.convert.to_megatron import convert_hf_to_megatron
    from tests.support.tiny import make_tiny_llava, make_tiny_onevision

    root = tmp_path_factory.mktemp("eval_models")
    out = {}
    for name, make, dtype in (("llava", make_tiny_llava, "bf16"), ("ov", make_tiny_onevision, "fp32")):
        hf = make(root / name)
        meg = convert_hf_to_megatron(hf, root / f"{name}_meg", tp=2, dtype=dtype)
        export = convert_megatron_to_hf(meg, root / f"{name}_export")
        out[name] = {"hf": hf, "meg": meg, "export": export}
    return out


def _generator(loaded, max_new_tokens=12):
    from megatron_vlm.eval.generate import Generator, Sampling

    return Generator(loaded, Sampling(max_new_tokens=max_new_tokens))


def _prompts(gen, kind):
    from megatron_vlm.eval.prompts import user_message

    if kind == "llava":
        cases = [(["red"], "what colour is it?"), ([], "say something"), (["blue", "green"], "compare them")]
        return [gen.encode([user_message(q, len(ims))], [_image(c) for c in ims]) for ims, q in cases]
    # anyres: a wide image (tiled), a tall one, two images (OneVision: base tiles only), text only
    cases = [([("red", (70, 30))], "what colour?"), ([("blue", (20, 55))], "and this?"),
             ([("green", (30, 30)), ("red", (41, 23))], "two images"), ([], "hello")]
    return [gen.encode([user_message(q, len(ims))], [_image(c, s) for c, s in ims]) for ims, q in cases]


def _printed_answers(sources: list[list[str]], image) -> list[str]:
    """What eval/generate.py prints about ``image`` for each model source's flags."""
    from megatron_vlm.eval import generate as generate_mod

    outs = []
    for src in sources:
        buf = io.StringIO()
        with redirect_stdout(buf):
            assert generate_mod.main([*src, "--image", str(image), "--prompt", "what colour?", "--max-new-tokens",
                                      "6", "--device", "cpu"]) == 0
        outs.append(buf.getvalue())
    return outs


@pytest.mark.slow  # in one process, but ~10-30 s each (models converted and exported)
@pytest.mark.parametrize("kind", ["llava", "ov"])
def test_generate_from_checkpoint_equals_export(models, kind, caplog):
    """--megatron-dir builds, in memory, the model megatron_to_hf writes: the same tensors, the same greedy tokens
    (each prompt alone and in one left-padded batch), and the command prints the same answer. The start-up line
    gives the compute dtype and the memory estimate, whose model part is the bytes the built model holds; every
    tensor reached transformers' loader lazily, one read at a time (never the checkpoint's whole state)."""
    import logging

    import transformers

    from megatron_vlm.eval import model as model_mod
    from megatron_vlm.eval.model import load

    m = models[kind]
    handed = []
    real = transformers.PreTrainedModel.from_pretrained.__func__

    def spy(cls, *args, state_dict=None, **kwargs):
        if state_dict is not None:
            handed.append({type(v) for v in state_dict.values()})
        return real(cls, *args, state_dict=state_dict, **kwargs)

    with caplog.at_level(logging.INFO, logger="megatron_vlm.eval.model"), \
            pytest.MonkeyPatch.context() as mp:
        mp.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(spy))
        from_ckpt = load(megatron_dir=m["meg"], tp=2, pp=1)
    assert handed == [{model_mod.LazyTensor}]
    stored = "bfloat16" if kind == "llava" else "float32"
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("reading "))
    assert f"stored in {stored}) into an HF " in line and "in float32 (the compute dtype) on cpu: about " in line, line
    held = {id(t): t.numel() * t.element_size() for t in [*from_ckpt.model.parameters(), *from_ckpt.model.buffers()]}
    config = type(from_ckpt.model.config).from_dict(from_ckpt.model.config.to_dict())
    assert model_mod.memory_needed(type(from_ckpt.model), config, torch.float32)[1] == sum(held.values())
    from_export = load(model_dir=m["export"])
    a, b = from_ckpt.model.state_dict(), from_export.model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    gen_c, gen_e = _generator(from_ckpt), _generator(from_export)
    pc, pe = _prompts(gen_c, kind), _prompts(gen_e, kind)
    alone_c = [gen_c.generate_ids([p])[0] for p in pc]
    alone_e = [gen_e.generate_ids([p])[0] for p in pe]
    assert alone_c == alone_e
    assert all(len(t) > 0 for t in alone_c)
    assert gen_c.generate_ids(pc) == alone_c  # left padding and batching change nothing
    # the command: the same printed answer from the checkpoint and from the export
    img = m["meg"].parent / f"{kind}_q.png"
    _image("red", (45, 30)).save(img)
    outs = _printed_answers([["--megatron-dir", str(m["meg"]), "--tp", "2"], ["--model", str(m["export"])]], img)
    assert outs[0] == outs[1] and outs[0].strip()
    with pytest.raises(Exception, match="--tp 4 does not match"):
        load(megatron_dir=m["meg"], tp=4)


@pytest.mark.slow  # one 4-rank world and the command's
def test_sharded_generation_equals_the_export(models, tmp_path, capsys):
    """--engine megatron: megatron-core's inference engine (its VLM controller and wrapper, the KV cache) on the
    sharded checkpoint itself gives the HF export's greedy tokens for each prompt (an image, text only, two images),
    at TP1, TP2, PP2 and TP2 x PP2 in one 4-rank world (in bf16 at TP2 x PP2: the same first tokens); a OneVision
    (anyres tiles, two images, a video, text only) gives its HF model's at TP2, PP2 and TP2 x PP2; the command
    prints the export's answer at TP2 x PP2 from a checkpoint written at TP2; --dtype fp16 is refused in one line."""
    from megatron_vlm.cli import run_cli
    from megatron_vlm.eval import generate as generate_mod
    from megatron_vlm.eval.model import load
    from megatron_vlm.eval.prompts import user_message
    from megatron_vlm.runtime.spawn import run_world
    from tests.support.worlds import sharded_generation

    from megatron_vlm.convert.to_megatron import convert_hf_to_megatron
    from tests.support.tiny import make_tiny_onevision
    from tests.support.videos import make_video

    m = models["llava"]
    # a OneVision on a Llama LM, whose random greedy tokens vary (the Qwen2 one of the fixture repeats one token)
    ov_hf = make_tiny_onevision(tmp_path / "ov", text_family="llama")
    ov = {"export": ov_hf, "meg": convert_hf_to_megatron(ov_hf, tmp_path / "ov_meg", tp=1, dtype="fp32")}
    cases = [(["red"], "what colour is it?"), ([], "say something"), (["blue", "green"], "compare them")]
    prompts = [([user_message(q, len(ims))], [_image(c) for c in ims]) for ims, q in cases]
    # OneVision: a wide image (tiles), a tall one, two images (base tiles only), a video, text only
    ov_cases = [([("red", (70, 30))], "what colour?"), ([("blue", (20, 55))], "and this?"),
                ([("green", (30, 30)), ("red", (41, 23))], "two images"), ([], "hello")]
    ov_prompts = [([user_message(q, len(ims))], [_image(c, size) for c, size in ims], []) for ims, q in ov_cases]
    ov_prompts.append(([user_message("what happens?", 0, 1)], [], [make_video(6)]))
    want = {}
    for name, cases_of in (("llava", [(msgs, ims, []) for msgs, ims in prompts]), ("ov", ov_prompts)):
        gen_e = _generator(load(model_dir=(ov if name == "ov" else m)["export"]))
        want[name] = [gen_e.generate_ids([gen_e.encode(*case)])[0] for case in cases_of]
        assert all(len(t) == 12 for t in want[name]), want  # no early end: every step of the KV cache is compared
        assert len({tuple(t) for t in want[name]}) == len(want[name]) and len(set(want[name][0])) > 1, want
    layouts = [(1, 1), (2, 1), (1, 2), (2, 2)]
    jobs = [dict(megatron_dir=str(m["meg"]), tp=tp, pp=pp, prompts=prompts, max_new_tokens=12) for tp, pp in layouts]
    jobs.append(dict(megatron_dir=str(m["meg"]), tp=2, pp=2, prompts=prompts, max_new_tokens=12, dtype="bf16"))
    jobs += [dict(megatron_dir=str(ov["meg"]), tp=tp, pp=pp, prompts=ov_prompts, max_new_tokens=12)
             for tp, pp in layouts[1:]]
    got = run_world(sharded_generation, 4, jobs)[0]
    for job, ids in zip(jobs, got):
        if job.get("dtype") == "bf16":  # megatron-core's Float16Module: the same start, rounding may turn a token
            assert [len(t) for t in ids] == [12] * len(want["llava"]), ids
            assert [t[:4] for t in ids] == [t[:4] for t in want["llava"]], ids
        else:
            assert ids == want["ov" if job["prompts"] is ov_prompts else "llava"], (job["tp"], job["pp"])
    img = tmp_path / "q.png"
    _image("red", (45, 30)).save(img)
    outs = _printed_answers([["--megatron-dir", str(m["meg"]), "--engine", "megatron", "--tp", "2", "--pp", "2"],
                             ["--model", str(m["export"])]], img)
    assert outs[0] == outs[1] and outs[0].strip()
    capsys.readouterr()
    assert run_cli(generate_mod.main, ["--megatron-dir", str(m["meg"]), "--engine", "megatron", "--dtype", "fp16",
                                       "--prompt", "hi", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--dtype bf16" in err[0], err
    assert run_cli(generate_mod.main, ["--megatron-dir", str(m["meg"]), "--engine", "megatron", "--image", str(img),
                                       "--prompt", "hi", "--device", "cpu", "--max-length", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # refused on the ranks, reported as one line
    assert len(err) == 1 and "exceeds --max-length 8; raise --max-length" in err[0], err


@pytest.mark.slow  # the models fixture
def test_a_model_that_does_not_fit_is_refused_in_one_line(models, monkeypatch, capsys):
    """Both ways refuse, before reading any weight, a model whose compute dtype does not fit in the memory
    available, naming what it needs and --dtype bf16 where that halves it (a bf16 checkpoint, fp32 on CPU)."""
    from megatron_vlm.cli import InputError, run_cli
    from megatron_vlm.convert import streaming
    from megatron_vlm.eval import generate as generate_mod
    from megatron_vlm.eval.model import load

    m = models["llava"]
    monkeypatch.setattr(streaming, "available_bytes", lambda: 1000)
    from megatron_vlm.convert import mcore_io

    monkeypatch.setattr(mcore_io.DistReader, "read", lambda *a: pytest.fail("weights read before the check"))
    with pytest.raises(InputError, match=r"--megatron-dir .*: the model in float32 needs about .* of memory, more "
                                         r"than 80% of the 1.00 kB available; pass --dtype bf16 \(about "):
        load(megatron_dir=m["meg"])
    img = m["meg"].parent / "refused.png"
    _image("red").save(img)
    args = ["--megatron-dir", str(m["meg"]), "--image", str(img), "--prompt", "hi", "--device", "cpu"]
    assert run_cli(generate_mod.main, args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len([x for x in err if x.startswith("error: ")]) == 1 and "pass --dtype bf16" in err[-1], err
    with pytest.raises(InputError, match=r"--model .*: the model in float32 needs about"):
        load(model_dir=m["export"])


@pytest.mark.slow  # in one process, but ~10-30 s each (models converted and exported)
def test_sampling_is_seeded(models):
    from megatron_vlm.eval.generate import Generator, Sampling
    from megatron_vlm.eval.model import load

    loaded = load(model_dir=models["llava"]["export"])
    runs = []
    for seed in (0, 0, 1):
        gen = Generator(loaded, Sampling(max_new_tokens=16, temperature=1.5, top_k=50, seed=seed))
        runs.append(gen.generate_ids(_prompts(gen, "llava")))
    assert runs[0] == runs[1] and runs[0] != runs[2]


@pytest.mark.slow  # in one process, but ~10-30 s each (models converted and exported)
def test_prompt_inputs_equal_hf_processor(models):
    """A prompt's input ids and pixels are what HF's processor (PIL backend) gives for the rendered prompt."""
    from transformers import AutoImageProcessor, AutoProcessor

    from megatron_vlm.eval.model import load
    from megatron_vlm.eval.prompts import user_message

    for kind in ("llava", "ov"):
        d = models[kind]["export"]
        gen = _generator(load(model_dir=d))
        images = [_image("red", (70, 30))]
        messages = [user_message("what colour?", 1)]
        ours = gen.encode(messages, images)
        try:
            proc = AutoProcessor.from_pretrained(str(d), backend="pil") if kind == "llava" else \
                AutoProcessor.from_pretrained(str(d), image_processor=AutoImageProcessor.from_pretrained(
                    str(d), backend="pil"))
        except ImportError as e:  # OneVision's processor class needs torchvision (the 3.11 lane has none)
            assert kind == "ov" and sys.version_info < (3, 12), e
            continue
        text = gen.prompts.chat.render(messages, add_generation_prompt=True)
        hf = proc(text=text, images=images, return_tensors="pt")
        assert hf["input_ids"][0].tolist() == ours.input_ids
        assert torch.equal(hf["pixel_values"].float(), ours.pixel_values)
        if kind == "ov":
            assert torch.equal(hf["image_sizes"], ours.image_sizes)


@pytest.mark.slow  # in one process, but ~10-30 s each (models converted and exported)
def test_exported_onevision_loads_with_autoprocessor(models):
    """The project's environment loads HF's OneVision processor (its video processor needs torchvision)."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        if sys.version_info < (3, 12):
            not_here("PyPI's torchvision is built for CUDA torch; the 3.11 lane's CPU torch has none to load")
        raise
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(str(models["ov"]["export"]))
    assert type(proc).__name__ == "LlavaOnevisionProcessor"
    assert type(proc.video_processor).__name__ == "LlavaOnevisionVideoProcessor"
    out = proc(text="<video>hi", videos=[torch.zeros(2, 3, 30, 40, dtype=torch.uint8)], return_tensors="pt")
    assert out["pixel_values_videos"].shape[:2] == (1, 2)
    # its video token count is the model's: 2 frames pooled, and one image_newline
    from megatron_vlm.model.spec import VLMSpec

    spec = VLMSpec.from_hf_dir(models["ov"]["export"])
    assert (out["input_ids"] == spec.video_token_id).sum() == spec.anyres.video_tokens(2)


@pytest.mark.parametrize("pred,ref,exact,vqa", [
    ("Red", "red", False, True),
    ("red.", "red", False, True),
    ("a red square", "red square", False, True),
    ("two", "2", False, True),
    ("The dog's bone", "dogs bone", False, False),
    ("dont know", "don't know", False, True),
    ("1,000", "1000", False, True),
    ("3.5", "3.5", True, True),
    ("3.5", "35", False, False),
    ("blue", "red", False, False),
    (" red ", "red", True, True),
])
def test_vqa_normalisation(pred, ref, exact, vqa):
    from megatron_vlm.eval.score import exact_match, vqa_match

    assert exact_match(pred, ref) is exact
    assert vqa_match(pred, ref) is vqa


@pytest.fixture(scope="module")
def colour_data(tmp_path_factory, models):
    """A make_wds VQA dataset of 8 coloured squares, all in its 'val' split."""
    from megatron_vlm.data.make_wds import make_wds

    root = tmp_path_factory.mktemp("eval_data")
    (root / "img").mkdir()
    rows = []
    for i, c in enumerate(COLOURS):
        _image(c).save(root / "img" / f"{i}.png")
        rows.append({"image": f"{i}.png", "question": "what colour is the square?", "answer": c, "id": str(i)})
    (root / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    make_wds("vqa", root / "qa.jsonl", root / "data", image_root=root / "img", shard_size=4, split="0,1,0",
             progress=False)
    return root / "data"


def _memorise(hf_dir, data, out_dir, steps=60):
    """The tiny LLaVA trained by HF (AdamW, all weights) on the split's samples as the trainer encodes them."""
    import shutil

    from megatron_vlm.data.task_encoder import VLMTaskEncoder
    from megatron_vlm.eval.evaluate import iterate_split
    from megatron_vlm.model.spec import VLMSpec
    from tests.support.hf_reference import hf_inputs
    from megatron_vlm.convert.verify import load_hf_model

    spec = VLMSpec.from_hf_dir(hf_dir)
    enc = VLMTaskEncoder(hf_dir, 256, spec=spec)
    loader, _ = iterate_split(data, "val", 8)
    samples = []
    for batch in loader:
        for it in batch:
            conv = it.messages + [{"role": "assistant", "content": [{"type": "text", "text": it.reference}]}]
            samples.append(type("S", (), enc.encode_conversation(conv, it.images, it.id)))
    torch.manual_seed(0)
    model = load_hf_model(hf_dir).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    inputs = [hf_inputs(s, spec) for s in samples]
    for _ in range(steps):
        opt.zero_grad()
        loss = sum(model(**i).loss for i in inputs) / len(inputs)
        loss.backward()
        opt.step()
    model.eval().save_pretrained(str(out_dir))
    for p in Path(hf_dir).iterdir():
        if p.is_file() and not p.name.endswith(".safetensors") and not (out_dir / p.name).exists():
            shutil.copy2(p, out_dir / p.name)
    return float(loss)


@pytest.mark.slow  # in one process, but ~10-30 s each (models converted and exported)
def test_evaluate_memorised_and_untrained(models, colour_data, tmp_path, capsys):
    """A model that memorised the split scores 100%, the untrained one 0%; one line per sample in --output."""
    from megatron_vlm.eval import evaluate as evaluate_mod

    hf = models["llava"]["hf"]
    trained = tmp_path / "memorised"
    final_loss = _memorise(hf, colour_data, trained)
    assert final_loss < 0.05, final_loss
    scores = {}
    for name, model in (("untrained", hf), ("memorised", trained)):
        out = tmp_path / f"{name}.jsonl"
        assert evaluate_mod.main(["--model", str(model), "--data-path", str(colour_data), "--split", "val",
                                  "--output", str(out), "--batch-size", "3", "--device", "cpu",
                                  "--no-progress"]) == 0
        printed = capsys.readouterr().out
        rows = [json.loads(x) for x in out.read_text().splitlines()]
        assert len(rows) == len(COLOURS)
        assert {r["reference"] for r in rows} == set(COLOURS)
        assert all(r["question"] == "what colour is the square?" for r in rows)
        assert set(rows[0]) == {"id", "question", "reference", "prediction", "correct", "vqa_correct"}
        scores[name] = sum(r["correct"] for r in rows) / len(rows)
        assert f"accuracy {100 * scores[name]:.1f}% (exact match)" in printed
    assert scores["memorised"] == 1.0 and scores["untrained"] == 0.0, scores
    # --engine megatron: the memorised model's Megatron checkpoint (TP1) scored by megatron-core's inference engine
    # on its sharded model at TP2 x PP2 gives the HF model's predictions, line for line
    from megatron_vlm.convert.to_megatron import convert_hf_to_megatron

    meg = convert_hf_to_megatron(trained, tmp_path / "memorised_meg", tp=1, dtype="fp32")
    out = tmp_path / "sharded.jsonl"
    assert evaluate_mod.main(["--megatron-dir", str(meg), "--engine", "megatron", "--tp", "2", "--pp", "2",
                              "--data-path", str(colour_data), "--split", "val", "--output", str(out), "--batch-size",
                              "3", "--device", "cpu", "--no-progress"]) == 0
    assert "accuracy 100.0% (exact match)" in capsys.readouterr().out
    assert out.read_text() == (tmp_path / "memorised.jsonl").read_text()
    # an empty split is one line naming it
    with pytest.raises(ValueError, match="no samples in its 'train' split"):
        evaluate_mod.main(["--model", str(hf), "--data-path", str(colour_data), "--split", "train", "--output",
                           str(tmp_path / "x.jsonl"), "--device", "cpu", "--no-progress"])
    assert not (tmp_path / "x.jsonl").exists()


@pytest.mark.slow  # matplotlib runs fc-list to build its font cache on a fresh machine
def test_plot_runs(tmp_path):
    """Curves of two runs on one figure; a resumed run's repeated iterations are read last-wins; a run's held-out
    accuracy gets its own panel."""
    from PIL import Image

    from megatron_vlm.eval import plot

    runs = []
    for r in range(2):
        d = tmp_path / f"run{r}"
        d.mkdir()
        lines = []
        t = 100.0
        for n, it in enumerate(list(range(1, 6)) + list(range(4, 9))):  # killed after 5, resumed from iteration 3
            t += 2.0 + (50.0 if n == 5 else 0.0)  # the resume's start-up
            lines.append({"iteration": it, "loss": 5.0 / it + r, "lr": 1e-3, "grad_norm": 1.0 + it, "skipped": False,
                          "samples": 8, "tokens": 800, "images": 8, "flops": 1.0, "time": t})
            if it == 4:
                lines.append({"iteration": it, "val_loss": 2.0})
            if r == 0 and it in (4, 8):  # run 0 answered held-out samples (--eval-generate-interval 4)
                lines.append({"iteration": it, "eval_exact": it / 16 + n / 100, "eval_vqa": it / 10, "eval_samples": 8,
                              "eval_seconds": 1.0})
        (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"iteration": 9, "lo')
        runs.append(d)
    s = plot.read_metrics(runs[0])
    assert sorted(s["loss"]) == list(range(1, 9))
    assert s["loss"][4] == 5.0 / 4 and s["val_loss"] == {4: 2.0}
    assert s["tokens_per_s"][2] == 400.0 and 4 not in s["tokens_per_s"] and s["tokens_per_s"][5] == 400.0
    # the accuracy records (percent; the resumed run's answering at 4 wins) sit beside the iterations, not over them
    assert s["eval_exact"] == {4: 100 * (4 / 16 + 5 / 100), 8: 100 * (8 / 16 + 9 / 100)}
    assert s["eval_vqa"] == {4: 40.0, 8: 80.0}
    assert [p[0] for p in plot.panels([s])][-1] == "eval_exact"
    assert plot.panels([plot.read_metrics(runs[1])]) == plot.PANELS  # no answers: the four panels as before
    out = tmp_path / "curves.png"
    assert plot.main([str(runs[0]), str(runs[1] / "metrics.jsonl"), "--output", str(out)]) == 0
    with Image.open(out) as im:
        assert im.format == "PNG" and im.size[0] > 500
    assert plot.write_run_figure(runs[0]) == runs[0] / "loss.png"
    assert plot.write_run_figure(tmp_path / "missing") is None
    (runs[1] / "metrics.jsonl").write_text("not json\n")
    assert plot.write_run_figure(runs[1]) is not None  # nothing to draw: empty panels, never an exception
