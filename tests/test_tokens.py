"""The image token, the chat template, the eos rule and the embedding rows, with tokenizers shaped like the real
ones (ChatML specials, Mistral v0.3 control tokens, built on the fly) and the real hub tokenizers
(llava-1.5-7b-hf, the OneVision Qwen2 vocabulary, vicuna-7b-v1.5's sentencepiece model; ../shared/hub).

tests/test_real_models.py runs the same shapes through every command end to end."""

from __future__ import annotations

import configparser
import json
import logging
import shutil

import pytest

from megatron_vlm.data.chat_template import (
    ChatTemplateError,
    choose_chat_template,
    llava_chat_template,
    with_image_parts,
)
from megatron_vlm.data.chat_tokens import ChatTokenizer
from tests.support import hub
from tests.support.tiny import (
    CHATML_TEMPLATE,
    chatml_tokenizer,
    make_text_model,
    make_vision_model,
    mistral_tokenizer,
    text_config,
    vision_config,
)
from megatron_vlm.model.tokenizer import add_vlm_tokens

from .conftest import ROOT, script

pytestmark = pytest.mark.one_lane(
    "3.11",
    reason="the image token, chat templates, eos rule and embedding rows: transformers and tokenizers, pinned "
           "alike in both lanes")


def user(*parts):
    return {"role": "user", "content": [{"type": "image"} if p is None else {"type": "text", "text": p}
                                        for p in parts]}


def asst(text):
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


CONV = [user(None, "What colour is the circle?"), asst("The circle is red."), user("And the square?"), asst("Blue.")]


@pytest.fixture(scope="module")
def llava15_tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(hub.hub_model_dir(hub.LLAVA_15)))


@pytest.fixture(scope="module")
def qwen2_tok(tmp_path_factory):
    """The real Qwen2 tokenizer of the OneVision checkpoint (its vocab.json, merges.txt, tokenizer_config.json)."""
    from transformers import AutoTokenizer

    from tests.support.hub_models import copy_token_files

    d = tmp_path_factory.mktemp("qwen2_tok")
    copy_token_files(hub.hub_model_dir(hub.ONEVISION_QWEN2), d)
    return AutoTokenizer.from_pretrained(str(d))


def tokenizer_shape(name, d):
    """(LM tokenizer, model family) of each shape; the real ones from the hub."""
    from transformers import AutoTokenizer

    if name == "chatml":
        return chatml_tokenizer(d), "qwen2"
    if name == "mistral_v03":
        return mistral_tokenizer(d), "mistral"
    if name == "qwen2_real":
        from tests.support.hub_models import copy_token_files

        copy_token_files(hub.hub_model_dir(hub.ONEVISION_QWEN2), d)
        return AutoTokenizer.from_pretrained(str(d)), "qwen2"
    if name == "vicuna_real":  # tokenizer.model only: needs sentencepiece
        from tests.support.hub_models import copy_token_files

        copy_token_files(hub.hub_model_dir(hub.VICUNA_15), d, ("tokenizer.model", "tokenizer_config.json",
                                                              "special_tokens_map.json"))
        return AutoTokenizer.from_pretrained(str(d)), "llama"
    raise ValueError(name)


def config_only_dir(d, tok, image_id: int, family: str, arch: str = "llava"):
    """An HF LLaVA directory without weights: what VLMSpec.from_hf_dir and the launcher's probe read."""
    from transformers import LlavaConfig, LlavaOnevisionConfig

    text = text_config(family, vocab_size=-(-len(tok) // 64) * 64).to_dict()
    if arch == "llava":
        cfg = LlavaConfig(vision_config=vision_config("clip").to_dict(), text_config=text, image_token_index=image_id)
    else:
        cfg = LlavaOnevisionConfig(vision_config=vision_config("siglip", image_size=20, patch_size=6).to_dict(),
                                   text_config=text, image_token_index=image_id, vision_feature_layer=-1,
                                   vision_feature_select_strategy="full", image_grid_pinpoints=[[20, 20], [20, 40]],
                                   vision_aspect_ratio="anyres_max_2")
    cfg.save_pretrained(str(d))
    tok.save_pretrained(str(d))
    return d


# (shape, arch, the image token id it must get: appended after the LM's own tokens / the real checkpoints' id)
SHAPES = [("chatml", "llava", None), ("mistral_v03", "llava", None), ("qwen2_real", "llava_onevision", 151646),
          ("vicuna_real", "llava", 32000)]


@pytest.mark.parametrize("shape,arch,want", SHAPES, ids=[s[0] for s in SHAPES])
def test_image_token_is_the_model_configs(shape, arch, want, tmp_path):
    """Item 1: the image token is the config's image_token_index, not the tokenizer's first extra special token
    (ChatML's <|im_start|>, Mistral's [INST], ...): the spec (hf_to_megatron, stats, training) and the launcher's
    probe read the same id."""
    from megatron_vlm.launch.probe import probe
    from megatron_vlm.model.spec import VLMSpec

    tok, family = tokenizer_shape(shape, tmp_path / "lm")
    n = len(tok)
    add_vlm_tokens(tok)
    image_id = tok.convert_tokens_to_ids("<image>")
    assert image_id == (want if want is not None else n)  # the LM's own tokens come first
    d = config_only_dir(tmp_path / "llava", tok, image_id, family, arch)
    spec = VLMSpec.from_hf_dir(d)
    assert (spec.image_token, spec.image_token_id, spec.arch) == ("<image>", image_id, arch)
    assert probe(False, False, str(d))["tokenizer"] == {"image": image_id, "pad": spec.pad_token_id}
    extra = [str(t) for t in tok.extra_special_tokens]
    if shape in ("chatml", "mistral_v03"):  # the shapes of the issue: the LM's extras come before <image>
        assert extra[0] == {"chatml": "<|im_start|>", "mistral_v03": "[INST]"}[shape] and extra[-1] == "<image>"


def test_image_token_mismatch_names_both_files_and_ids(hf_models, tmp_path, capsys):
    """A config and a processor/tokenizer that disagree stop the converter with one line naming both."""
    from megatron_vlm.cli import run_cli

    bad = tmp_path / "bad"
    shutil.copytree(hf_models["qwen2_siglip"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    proc = json.loads((bad / "processor_config.json").read_text())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(bad))
    image_id, pad_id = tok.convert_tokens_to_ids("<image>"), tok.pad_token_id
    assert proc["image_token"] == "<image>" and cfg["image_token_index"] == image_id
    cfg["image_token_index"] = pad_id
    (bad / "config.json").write_text(json.dumps(cfg))
    rc = run_cli(script("convert/hf_to_megatron.py").main, ["--hf-dir", str(bad), "--megatron-dir",
                                                             str(tmp_path / "out")])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and not (tmp_path / "out").exists()
    assert line == (
        f"error: image token mismatch: {bad}/config.json has image_token_index {pad_id} (the tokenizer's "
        f"{tok.pad_token!r}), "
        f"but {bad}/processor_config.json's image_token names '<image>', which the tokenizer in {bad} maps to id "
        f"{image_id}; make them agree (set image_token_index to {image_id}, or image_token to the token at {pad_id})")

    # no processor naming a token: the config's id must be an added token of the tokenizer
    (bad / "processor_config.json").unlink()
    cfg["image_token_index"] = 5
    (bad / "config.json").write_text(json.dumps(cfg))
    from megatron_vlm.model.spec import VLMSpec
    from megatron_vlm.model.tokenizer import ImageTokenError

    with pytest.raises(ImageTokenError) as e:
        VLMSpec.from_hf_dir(bad)
    assert str(e.value) == (
        f"{bad}/config.json has image_token_index 5, but in the tokenizer in {bad} ({len(tok)} tokens) that id is "
        f"the tokenizer's {tok.convert_ids_to_tokens(5)!r}, not an added image token; give the tokenizer the model "
        "was built with (convert/build_llava.py adds '<image>')")


def test_build_keeps_the_lms_chat_template_and_embedding_rows(tmp_path, caplog):
    """Friction: build_llava keeps a ChatML LM's template (image parts rendered as <image>) and its padded
    embedding rows; --chat-template llava asks for LLaVA-1.5's; both are logged."""
    from transformers import AutoProcessor, AutoTokenizer, LlavaConfig

    from megatron_vlm.cli import run_cli

    lm = make_text_model(tmp_path / "lm", "qwen2", tokenizer="chatml", vocab_rows=384)
    vit = make_vision_model(tmp_path / "vit", "clip")
    out = tmp_path / "llava"
    with caplog.at_level(logging.INFO):
        assert run_cli(script("convert/build_llava.py").main,
                       ["--text-model", str(lm), "--vision-model", str(vit), "--save-dir", str(out)]) == 0
    n_lm = len(AutoTokenizer.from_pretrained(str(lm)))
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.chat_template == with_image_parts(CHATML_TEMPLATE)
    assert LlavaConfig.from_pretrained(str(out)).text_config.vocab_size == 384  # not shrunk to len(tok)
    assert len(tok) == n_lm + 1 and LlavaConfig.from_pretrained(str(out)).image_token_id == n_lm
    proc = AutoProcessor.from_pretrained(str(out))
    prompt = proc.apply_chat_template([user(None, "what colour is it ?")], add_generation_prompt=True)
    assert prompt == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<image>\n"
                      "what colour is it ?<|im_end|>\n<|im_start|>assistant\n")
    log = "\n".join(r.getMessage() for r in caplog.records)
    assert f"chat template: --text-model {lm}'s own, with image parts rendered as '<image>' + newline" in log
    assert f"vocabulary: {n_lm + 1} tokens ({n_lm} of the LM + <image>); embedding rows 384 -> 384 (the LM's" in log

    assert run_cli(script("convert/build_llava.py").main,
                   ["--text-model", str(lm), "--vision-model", str(vit), "--save-dir", str(tmp_path / "l2"),
                    "--chat-template", "llava", "--vocab-size-padding", "128"]) == 0
    assert AutoTokenizer.from_pretrained(str(tmp_path / "l2")).chat_template == llava_chat_template()
    assert LlavaConfig.from_pretrained(str(tmp_path / "l2")).text_config.vocab_size == 384


def test_choose_chat_template(llava15_tok, qwen2_tok, tmp_path):
    """keep: a template that renders image parts stays as it is (llava-1.5's), a string-only one (the OneVision
    Qwen2 ChatML) gets the image-parts preamble, an LM without one gets LLaVA-1.5's; one that cannot render
    images is refused with the fix named."""
    real = (hub.hub_model_dir(hub.LLAVA_15) / "chat_template.jinja").read_text()
    llava15_tok.chat_template = real
    assert choose_chat_template(llava15_tok).template == real
    chosen = choose_chat_template(qwen2_tok, what="qwen2")
    assert chosen.template == with_image_parts(qwen2_tok.chat_template)
    assert qwen2_tok.apply_chat_template(CONV[:2], chat_template=chosen.template, tokenize=False) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<image>\nWhat colour is the "
        "circle?<|im_end|>\n<|im_start|>assistant\nThe circle is red.<|im_end|>\n")
    text_only = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]  # string contents
    assert qwen2_tok.apply_chat_template(text_only, chat_template=chosen.template, tokenize=False) == \
        qwen2_tok.apply_chat_template(text_only, tokenize=False)
    bare = chatml_tokenizer(tmp_path / "bare")
    bare.chat_template = None
    assert choose_chat_template(bare).template == llava_chat_template()
    drops = "{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endfor %}"
    (tmp_path / "t.jinja").write_text(drops)
    with pytest.raises(ChatTemplateError, match=r"cannot render image parts: it renders an image part as 0 "
                                                r"'<image>' tokens, and with string contents .*; pass "
                                                r"--chat-template llava"):
        choose_chat_template(bare, str(tmp_path / "t.jinja"))


def test_eos_closes_answers_the_template_leaves_open(llava15_tok, qwen2_tok, caplog):
    """Item 9: llava-1.5-7b-hf's template ends answers with a space, no end token; the eos is inserted after
    each answer and trained on (LLaVA's own training puts </s> there). ChatML closes with <|im_end|>: nothing is
    inserted. Logged once."""
    template = (hub.hub_model_dir(hub.LLAVA_15) / "chat_template.jinja").read_text() + "{# eos-rule test #}"
    with caplog.at_level(logging.INFO, logger="megatron_vlm.data.chat_tokens"):
        ct = ChatTokenizer(llava15_tok, template)
        ChatTokenizer(llava15_tok, template)
    assert [r.getMessage() for r in caplog.records] == [
        "the chat template closes no assistant turn with an end token: appending the eos '</s>' (id 2) after every "
        "answer, in the tokens and in the loss, so that the model learns to stop"]
    c = ct(CONV)
    assert c.text == ("USER: <image>\nWhat colour is the circle? ASSISTANT: The circle is red. USER: And the square? "
                      "ASSISTANT: Blue. ")
    tokens = llava15_tok.convert_ids_to_tokens(c.ids)
    trained = [t for t, a in zip(tokens, c.assistant) if a]
    assert trained == ["▁The", "▁circle", "▁is", "▁red", ".", "</s>", "▁Blue", ".", "</s>"]
    assert c.inserted_eos == [24, 39] and [c.ids[i] for i in c.inserted_eos] == [2, 2]
    assert tokens[25:28] == ["▁US", "ER", ":"] and tokens[-1] == "▁"  # the template's text goes on unchanged
    assert ct.append_eos and ct.closing_token is None
    # the template writes no BOS and the tokenizer adds one: prepended, as HF's processor does at inference
    assert c.prepended_bos and tokens[:4] == ["<s>", "▁US", "ER", ":"]

    chatml = ChatTokenizer(qwen2_tok, with_image_parts(qwen2_tok.chat_template))
    c = chatml(CONV)
    assert chatml.closing_token == "<|im_end|>" and not chatml.append_eos and c.inserted_eos == []
    trained = [t for t, a in zip(qwen2_tok.convert_ids_to_tokens(c.ids), c.assistant) if a]
    assert trained == ["The", "Ġcircle", "Ġis", "Ġred", ".", "<|im_end|>", "Blue", ".", "<|im_end|>"]


# The OneVision Qwen2 template has no {% generation %} blocks; this is its generation-marked equivalent (the answer
# and the <|im_end|> that closes it inside the block, as HF's docs mark ChatML turns).
CHATML_GENERATION = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_assistant_mask_against_hf_generation_blocks(llava15_tok, qwen2_tok):
    """Item 9: our assistant mask vs HF's return_assistant_tokens_mask on the real templates. llava-1.5-7b-hf's
    has {% generation %} blocks; the OneVision Qwen2 ChatML has none, so its generation-marked equivalent
    (CHATML_GENERATION) is used. They agree except that HF also marks the token carrying the space the llava-1.5
    template writes after each answer inside its block: the next turn's '▁US' and the final '▁'. Ours leaves
    them out: after the generation prompt 'ASSISTANT:' the model must say the answer and stop (the eos we
    insert right after it), not start 'USER' or emit a lone space."""
    cases = {
        "llava15": (llava15_tok, (hub.hub_model_dir(hub.LLAVA_15) / "chat_template.jinja").read_text(), CONV),
        "chatml": (qwen2_tok, CHATML_GENERATION,
                   [{"role": m["role"], "content": "".join("<image>\n" if p["type"] == "image" else p["text"]
                                                           for p in m["content"])} for m in CONV]),
    }
    diffs = {}
    for name, (tok, template, conv) in cases.items():
        hf = tok.apply_chat_template(conv, chat_template=template, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
        ours = ChatTokenizer(tok, template)(conv)
        skip = set(ours.inserted_eos) | ({0} if ours.prepended_bos else set())
        keep = [i for i in range(len(ours.ids)) if i not in skip]  # the rendered text's tokens
        assert [ours.ids[i] for i in keep] == hf["input_ids"]
        mine = [ours.assistant[i] for i in keep]
        diffs[name] = [(tok.convert_ids_to_tokens(t), bool(h), m)
                       for t, h, m in zip(hf["input_ids"], hf["assistant_masks"], mine) if bool(h) != m]
    assert diffs == {"llava15": [("▁US", True, False), ("▁", True, False)], "chatml": []}


@pytest.mark.parametrize("lm_rows,tokens,padding,rows", [
    (32000, 32001, None, 32064),  # vicuna + <image> (pad = <unk>): llava-1.5-7b-hf's 32064
    (152064, 151647, None, 152064),  # Qwen2: the LM's rows already hold the tokenizer
    (300, 302, None, 320),
    (300, 302, 1, 302),  # exactly the tokenizer
    (152064, 151647, 128, 152064), (384, 304, 256, 512), (303, 304, 64, 320),
])
def test_embedding_rows(lm_rows, tokens, padding, rows):
    from megatron_vlm.model.tokenizer import embedding_rows

    assert embedding_rows(lm_rows, tokens, padding) == rows


def test_sentencepiece_is_a_pinned_dependency(tmp_path):
    """Item 11: sentencepiece-only LMs (vicuna-7b-v1.5: tokenizer.model, no tokenizer.json) need sentencepiece
    (+ protobuf) for transformers to convert them; they are dependencies, pinned in both lanes, and vicuna's
    tokenizer then reads as llava-1.5-7b-hf's tokenizer.json does (32000 tokens)."""
    from transformers import AutoTokenizer

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    requires = [r.split(">")[0].split("=")[0].strip() for r in cfg["options"]["install_requires"].split("\n") if r]
    for name in ("sentencepiece", "protobuf"):
        assert name in requires
        for lane in ("py311", "py312"):
            assert any(line.startswith(f"{name}==") for line in (ROOT / "constraints" / f"{lane}.txt").open())
    vicuna, _ = tokenizer_shape("vicuna_real", tmp_path)
    ref = AutoTokenizer.from_pretrained(str(hub.hub_model_dir(hub.LLAVA_15)))
    text = "USER: What colour is the circle? ASSISTANT: The circle is red."
    assert len(vicuna) == 32000 and vicuna.is_fast
    assert vicuna(text)["input_ids"] == ref(text)["input_ids"] == [
        1, 3148, 1001, 29901, 1724, 12384, 338, 278, 8607, 29973, 319, 1799, 9047, 13566, 29901, 450, 8607, 338,
        2654, 29889]


def _overfit(hf_dir, encoder, messages, image, steps: int, seed: int = 0):
    """The HF model of ``hf_dir`` trained on ONE sample as the trainer sees it (the task encoder's tokens,
    labels and loss mask, each image token expanded), in a plain PyTorch loop; returns the model."""
    import torch
    from transformers import LlavaForConditionalGeneration

    out = encoder.encode_conversation(messages, [image])
    x = out["tokens"].tolist() + out["labels"][-1:].tolist()
    mask = [0.0] + out["loss_mask"].tolist()  # loss_mask[i] belongs to labels[i] = x[i + 1]
    ids, labels = [], []
    for t, m in zip(x, mask):
        n = encoder.tokens_per_image if t == encoder.image_token_id else 1
        ids += [t] * n
        labels += [t if m else -100] * n
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration.from_pretrained(str(hf_dir))
    model.model.vision_tower.requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    ids, labels = torch.tensor([ids]), torch.tensor([labels])
    for _ in range(steps):
        loss = model(input_ids=ids, pixel_values=out["images"], labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), float(loss)


@pytest.mark.slow  # trains two tiny models for 40 steps each (~15 s on an idle 2-core machine)
def test_a_model_trained_on_an_open_template_learns_to_stop(tmp_path):
    """Item 9: with llava-1.5-7b-hf's template (no end token after answers), a tiny LLaVA overfit on one sample
    of our training data says the answer and stops at the eos; the same training without the eos rule (the
    negative control) never stops."""
    import torch
    from PIL import Image
    from transformers import AutoProcessor

    from megatron_vlm.data.task_encoder import VLMTaskEncoder
    from tests.support.tiny import make_tiny_llava

    hf = make_tiny_llava(tmp_path / "m", "llama", "clip")
    (hf / "chat_template.jinja").write_text((hub.hub_model_dir(hub.LLAVA_15) / "chat_template.jinja").read_text())
    question, answer = "what colour is the shape ?", "the shape is red ."
    messages = [user(None, question), asst(answer)]
    image = Image.new("RGB", (32, 32), (220, 30, 30))
    proc = AutoProcessor.from_pretrained(str(hf))
    prompt = proc.apply_chat_template(messages[:1], add_generation_prompt=True)
    assert prompt == f"USER: <image>\n{question} ASSISTANT:"
    inputs = proc(images=image, text=prompt, return_tensors="pt")
    n = inputs["input_ids"].shape[1]
    eos = proc.tokenizer.eos_token_id
    said = {}
    for rule in (True, False):
        enc = VLMTaskEncoder(hf, seq_length=64)
        assert enc.chat.append_eos
        enc.chat.append_eos = rule
        model, loss = _overfit(hf, enc, messages, image, steps=40)
        with torch.no_grad():
            gen = model.generate(**inputs, max_new_tokens=12, do_sample=False, eos_token_id=eos)[0, n:].tolist()
        said[rule] = (proc.tokenizer.decode([t for t in gen if t != eos]).strip(), gen[-1] == eos, len(gen), loss)
    assert said[True][:3] == (answer, True, len(proc.tokenizer(" " + answer)["input_ids"]) + 1), said
    assert said[False][1:3] == (False, 12), said  # without the eos the answer runs on to max_new_tokens


@pytest.fixture(scope="module")
def qwen3_tok(tmp_path_factory):
    """The real Qwen3 tokenizer: Qwen3-4B-Instruct-2507's tokenizer_config.json (thinking chat template) over the
    Qwen2 vocab.json / merges.txt it shares (151,669 tokens)."""
    from transformers import AutoTokenizer

    from tests.support.hub_models import copy_token_files

    d = tmp_path_factory.mktemp("qwen3_tok")
    copy_token_files(hub.hub_model_dir(hub.ONEVISION_QWEN2), d, ("vocab.json", "merges.txt"))
    copy_token_files(hub.hub_model_dir(hub.QWEN3_4B), d, ("tokenizer_config.json",))
    tok = AutoTokenizer.from_pretrained(str(d))
    assert len(tok) == 151669 and tok.convert_tokens_to_ids("<think>") == 151667
    return tok


def _trained(tok, conv) -> list[str]:
    """The text of each run of trained tokens."""
    runs, cur = [], []
    for i, a in zip(conv.ids, conv.assistant):
        if a:
            cur.append(i)
        elif cur:
            runs, cur = runs + [cur], []
    return [tok.decode(r) for r in runs + ([cur] if cur else [])]


THREE_TURNS = CONV + [user("And the triangle?"), asst("Green.")]


def test_loss_rule_on_every_real_template(llava15_tok, qwen2_tok, qwen3_tok, caplog, monkeypatch):
    """The loss rule on each real chat template in ../shared/hub (as build_llava installs it): for each assistant
    turn the tokens before the trained ones are the tokens of the conversation up to it rendered with the generation
    prompt, as at inference, and the trained ones run to the token closing the turn. Qwen3's thinking template
    breaks the prefix property for turns before the last user query (logged once) and its generation prompt ends
    inside a token of the full text (tokenized apart there, logged once)."""
    bare = llava15_tok.__class__.from_pretrained(str(hub.hub_model_dir(hub.LLAVA_15)))
    cases = {
        "llava-1.5-7b-hf": (bare, (hub.hub_model_dir(hub.LLAVA_15) / "chat_template.jinja").read_text(),
                            ["The circle is red.</s>", "Blue.</s>", "Green.</s>"]),
        "onevision-qwen2": (qwen2_tok, None, ["The circle is red.<|im_end|>", "Blue.<|im_end|>", "Green.<|im_end|>"]),
        "qwen3-4b-2507": (qwen3_tok, None, ["The circle is red.<|im_end|>", "Blue.<|im_end|>",
                                            "\n</think>\n\nGreen.<|im_end|>"]),
    }
    from megatron_vlm.data import chat_tokens

    monkeypatch.setattr(chat_tokens, "_LOGGED", set())  # other tests of this process logged these templates
    logged = {}
    for name, (tok, template, want) in cases.items():
        template = template or choose_chat_template(tok, "keep").template
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="megatron_vlm.data.chat_tokens"):
            ct = ChatTokenizer(tok, template)
            conv = ct(THREE_TURNS)
            ct(THREE_TURNS)
        logged[name] = [r.getMessage() for r in caplog.records]
        assert _trained(tok, conv) == want, name
        kept = [t for k, t in enumerate(conv.ids) if k not in set(conv.inserted_eos)]
        mask = [a for k, a in enumerate(conv.assistant) if k not in set(conv.inserted_eos)]
        for i in (1, 3, 5):
            prompt = ct.render(THREE_TURNS[:i], add_generation_prompt=True)
            if not conv.text.startswith(prompt):
                assert name == "qwen3-4b-2507" and i < 5  # turns before the last user query: no <think> block
                continue
            ids = ([tok.bos_token_id] if conv.prepended_bos else []) + tok(prompt, add_special_tokens=False)[
                "input_ids"]
            assert kept[:len(ids)] == ids and not mask[len(ids) - 1] and mask[len(ids)], (name, i)
    assert [len(v) for v in logged.values()] == [1, 1, 3]
    q3 = " | ".join(logged["qwen3-4b-2507"])
    assert q3.count("Qwen3 writes <think> blocks only after the last user query") == 1
    assert q3.count("'<think>\\n' + '\\n</think'): the prompt and the answer are tokenized apart there") == 1


def test_qwen3_tool_calls_follow_the_loss_rule(qwen3_tok):
    """An assistant turn that calls a tool trains the call and its <|im_end|>; the final answer after the tool's
    response trains the closing of the empty think block, the answer and <|im_end|>."""
    ct = ChatTokenizer(qwen3_tok, choose_chat_template(qwen3_tok, "keep").template)
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    conv = ct([user("Weather in Paris?"), {"role": "assistant", "content": "", "tool_calls": [{"function": call}]},
               {"role": "tool", "content": "22C"}, asst("It is 22C.")])
    assert _trained(qwen3_tok, conv) == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "\n</think>\n\nIt is 22C.<|im_end|>"]
