"""Real-shaped and real hub tokenizers through every command: build_llava -> make_wds -> stats ->
hf_to_megatron --verify -> train/run.py -> megatron_to_hf -> HF generate, checking the image token id at each step.

Worlds (random-weight models, small but with the real vocabularies where the hub files give them):
(A Qwen2-Instruct-shaped LM -- byte-level BPE, ChatML specials and template, more rows than tokens -- takes the
README's whole path, stages, resume and extension included, in tests/test_newcomer.py.)
- ``mistral_v03``: a Mistral-v0.3-shaped LM (768 control tokens in the first ids, [INST] template) + CLIP;
- ``vicuna``: lmsys/vicuna-7b-v1.5's tokenizer.model only (sentencepiece), 32000 rows -> 32064 + CLIP;
- ``llava15``: llava-hf/llava-1.5-7b-hf's own directory (tokenizer.json, processor, chat template that closes
  no answer), converted directly;
- ``onevision_qwen2``: a OneVision on the real Qwen2 vocabulary and added tokens (152064 rows, <image> =
  151646) + SigLIP: the issue's `tokenizer's '<|im_start|>' id 151644 != config image_token_id 151646`;
- ``onevision_qwen3``: a OneVision on Qwen3-4B-Instruct-2507's config (q/k norms, head_dim, tied, 151936 rows) and
  real tokenizer and thinking template (151,669 tokens, <image> = 151669) + SigLIP.
The ``llava15`` world (whose template closes no answer) trains long enough to overfit its one answer; greedy
``generate`` must then say it and stop at the eos the trainer inserted (tests/test_tokens.py shows the negative
control, and the same on a tiny model).
"""

from __future__ import annotations

import json
import re
import sys

import pytest

from tests.support import forked_cli, hub_models
from tests.support.tiny import make_text_model, make_vision_model

from .conftest import ROOT, script

pytestmark = [pytest.mark.slow, pytest.mark.one_lane(
    "3.11",
    reason="real hub tokenizers' image token through every command; the commands' version-sensitive steps are "
           "held in both lanes by the modules named",
    covered_by=("test_lm_families", "test_convert", "test_train"))]


QUESTION, ANSWER = "What colour is the circle?", "The circle is red."


def _build(root, lm, vit, *extra):
    from megatron_vlm.cli import run_cli

    out = root / "hf"
    assert run_cli(script("convert/build_llava.py").main,
                   ["--text-model", str(lm), "--vision-model", str(vit), "--save-dir", str(out), *extra]) == 0
    return out


def mistral_v03(root):
    return _build(root, make_text_model(root / "lm", "mistral", tokenizer="mistral_v03"),
                  make_vision_model(root / "vit", "clip"))


def vicuna(root):
    return _build(root, hub_models.vicuna_text_model(root / "lm"), make_vision_model(root / "vit", "clip"))


def llava15(root):
    return hub_models.llava15_model(root / "hf", image_size=56)


def onevision_qwen2(root):
    return _build(root, hub_models.qwen2_text_model(root / "lm"),
                  hub_models.siglip_vision_model(root / "vit", image_size=20, patch_size=6),
                  "--arch", "llava_onevision", "--max-grid", "3", "--vision-aspect-ratio", "anyres_max_2",
                  "--vision-feature-layer", "-1")


def onevision_qwen3(root):
    return _build(root, hub_models.qwen3_text_model(root / "lm"),
                  hub_models.siglip_vision_model(root / "vit", image_size=20, patch_size=6),
                  "--arch", "llava_onevision", "--max-grid", "3", "--vision-aspect-ratio", "anyres_max_2",
                  "--vision-feature-layer", "-1")


# name -> (builder, image token id (None: the LM tokenizer's length), embedding rows (None: from the LM), pad
# token, the token closing each answer, eos inserted by the trainer, training iterations)
WORLDS = {
    "mistral_v03": (mistral_v03, None, None, "<pad>", "</s>", False, 3),
    "vicuna": (vicuna, 32000, 32064, "<unk>", "</s>", False, 3),
    "llava15": (llava15, 32000, 32064, "<pad>", "</s>", True, 40),
    "onevision_qwen2": (onevision_qwen2, 151646, 152064, "<|endoftext|>", "<|im_end|>", False, 3),
    "onevision_qwen3": (onevision_qwen3, 151669, 151936, "<|endoftext|>", "<|im_end|>", False, 3),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Eight 64x48 red images with one question and one answer (make_wds, all in the train split)."""
    from PIL import Image

    from megatron_vlm.cli import run_cli

    root = tmp_path_factory.mktemp("real_data")
    (root / "img").mkdir()
    rows = []
    for i in range(8):
        Image.new("RGB", (64, 48), (220, 30 + i, 30)).save(root / "img" / f"{i}.png")
        rows.append({"image": f"{i}.png", "question": QUESTION, "answer": ANSWER, "id": str(i)})
    (root / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert run_cli(script("data_prep/make_wds.py").main,
                   ["--format", "vqa", "--input", str(root / "qa.jsonl"), "--image-root", str(root / "img"),
                    "--output", str(root / "data"), "--split", "1,0,0", "--no-progress"]) == 0
    return root / "data"


def cli(capsys, rel, *args) -> str:
    from megatron_vlm.cli import run_cli

    rc = run_cli(script(rel).main, [str(a) for a in args])
    out = capsys.readouterr()
    assert rc == 0, out.err[-3000:]
    return out.out


def image_ids(hf_dir) -> tuple[int, int, int]:
    """(config's image_token_index, the tokenizer's id of '<image>', embedding rows) of an HF directory."""
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(str(hf_dir))
    return cfg.image_token_id, AutoTokenizer.from_pretrained(str(hf_dir)).convert_tokens_to_ids("<image>"), \
        cfg.text_config.vocab_size


@pytest.mark.parametrize("world", list(WORLDS))
def test_user_path(world, data, tmp_path, capsys):
    from transformers import AutoTokenizer

    from megatron_vlm.data.anyres_encoder import task_encoder_for
    from megatron_vlm.model.spec import VLMSpec

    build, want_id, want_rows, pad, closing, inserted, iters = WORLDS[world]
    hf = build(tmp_path)
    capsys.readouterr()
    # 1. build: the config's image token is the tokenizer's <image>, after the LM's own tokens
    tok = AutoTokenizer.from_pretrained(str(hf))
    lm_len = len(AutoTokenizer.from_pretrained(str(tmp_path / "lm"))) if (tmp_path / "lm").is_dir() else None
    want_id = lm_len if want_id is None else want_id
    want_rows = want_rows or -(-len(tok) // 64) * 64
    assert image_ids(hf) == (want_id, want_id, want_rows)
    assert tok.pad_token == pad
    spec = VLMSpec.from_hf_dir(hf)
    enc = task_encoder_for(spec, hf, 256)
    assert (enc.chat.closing_token, enc.chat.append_eos) == (None if inserted else closing, inserted)

    # 2. stats: text tokens as the trainer counts them (the inserted eos included), image tokens from the spec
    cli(capsys, "data_prep/stats.py", data, "--tokenizer", hf, "--seq-length", 256, "--output-dir", tmp_path / "st",
        "--no-progress")
    stats = json.loads((tmp_path / "st" / "stats.json").read_text())["total"]["train"]
    from megatron_vlm.data.conversation import vqa_messages

    conv = enc.chat(vqa_messages(QUESTION, ANSWER))
    assert (enc.image_token_id, enc.tokenizer_image_token_id, conv.ids.count(want_id)) == (want_id, want_id, 1)
    per_image = spec.anyres.num_tokens(48, 64, True) if spec.is_anyres else spec.num_image_tokens
    assert (stats["samples"], stats["image_tokens"], stats["text_tokens"]) == \
        (8, 8 * per_image, 8 * (len(conv.ids) - 1))
    pieces = [conv.text[a:b] for a, b in zip([0, *conv.cuts], [*conv.cuts, len(conv.text)])]  # Qwen3: prompt | answer
    assert len(conv.ids) == sum(len(tok(p, add_special_tokens=False)["input_ids"]) for p in pieces) + inserted + \
        conv.prepended_bos
    assert bool(conv.cuts) == (world == "onevision_qwen3")  # '<think>\n' + '\n</think>' tokenized apart
    assert conv.prepended_bos == (world == "llava15")  # its template writes no BOS; HF's processor adds one

    # 3. hf_to_megatron --verify: the checkpoint's spec has the config's image token; fp32 logits agree
    meg = tmp_path / "meg"
    out = cli(capsys, "convert/hf_to_megatron.py", "--hf-dir", hf, "--megatron-dir", meg, "--verify")
    diff = float(re.search(r"verify: max \|logit diff\| .* = (\S+) <=", out).group(1))
    assert diff < 1e-4
    with capsys.disabled():
        print(f"\n{world}: image token {want_id}, {want_rows} rows, verify max |logit diff| {diff:.3g}")
    ck = json.loads((meg / "release" / "vlm_spec.json").read_text())
    assert (ck["image_token"], ck["image_token_id"], ck["vocab_size"]) == ("<image>", want_id, want_rows)

    # 4. train/run.py (the launcher's probe reads the ids from the tokenizer directory and checks them)
    seq = 256  # a cap: batches pad to their longest sample
    p = forked_cli.run([sys.executable, "train/run.py", "--device", "cpu", "-g", "1", "--stage", "2",
                        "--megatron-load-dir", str(meg), "--tokenizer-load-dir", str(hf), "--data-path", str(data),
                        "--save-dir", str(tmp_path / "runs"), "--name", "r", "--micro-batch-size", "2",
                        "--global-batch-size", "2", "--seq-length", str(seq), "--train-iters", str(iters),
                        "--lr", "3e-3", "--lr-decay-style", "constant", "--lr-warmup-fraction", "0",
                        "--log-interval", "1", "--num-workers", "1", "--save-interval", str(iters)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    log = p.stdout + p.stderr
    rule = ("appending the eos '</s>' (id 2) after every answer" if inserted else
            f"the chat template closes assistant turns with {closing!r}")
    assert log.count(rule) == 1, log[-3000:]
    losses = [json.loads(x)["loss"] for x in (tmp_path / "runs" / "r" / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in x]
    assert len(losses) == iters and losses[-1] < losses[0]
    run_spec = json.loads((tmp_path / "runs" / "r" / f"iter_{iters:07d}" / "vlm_spec.json").read_text())
    assert run_spec["image_token_id"] == want_id

    # 5. megatron_to_hf: the exported model and tokenizer keep the image token and the rows
    exported = tmp_path / "out"
    cli(capsys, "convert/megatron_to_hf.py", "--megatron-dir", tmp_path / "runs" / "r", "--hf-dir", exported)
    assert image_ids(exported) == (want_id, want_id, want_rows)
    if iters < 10:
        return

    # 6. the overfit answer is said and closed: greedy generate stops at the end token
    from PIL import Image

    from megatron_vlm.convert.verify import load_hf_model

    model = load_hf_model(exported)
    model.generation_config.pad_token_id = tok.pad_token_id
    prompt = enc.chat.render([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
                             add_generation_prompt=True)
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(str(exported))
    inputs = proc(images=Image.new("RGB", (64, 48), (220, 30, 30)), text=prompt, return_tensors="pt",
                  add_special_tokens=not prompt.startswith(tok.bos_token or "\0"))  # as HF's apply_chat_template
    n = inputs["input_ids"].shape[1]
    gen = model.generate(**inputs, max_new_tokens=20, do_sample=False)[0, n:].tolist()
    stop = tok.convert_tokens_to_ids(closing)
    assert gen[-1] == stop and len(gen) < 20, tok.convert_ids_to_tokens(gen)
    assert tok.decode(gen[:-1]).strip() == ANSWER, tok.convert_ids_to_tokens(gen)
