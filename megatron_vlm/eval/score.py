"""Answer matching: exact, and VQA-normalised as the VQAv2 evaluation normalises answers.

:func:`exact_match`: the prediction equals the reference after surrounding whitespace is stripped.

:func:`vqa_normalize` applies the VQAv2 evaluation's rules (``vqaEval.py`` of the VQA API) to one answer:
newlines and tabs become spaces; punctuation is removed where it touches a space (or in a number such as
``1,000``) and becomes a space elsewhere, ``.`` is removed unless it stands between digits; then, word by
word, the text is lower-cased, number words become digits (``none``/``zero`` ... ``ten``), the articles ``a``,
``an``, ``the`` are dropped and common contractions written without their apostrophe get it back (``dont`` ->
``don't``). Two answers match when their normal forms are equal. With one reference per question (what an
energon dataset made by ``data_prep/`` holds) this is VQAv2's accuracy with one annotator: a match counts 1,
anything else 0 (VQAv2's ``min(#humans that said it / 3, 1)`` needs its ten answers per question).
"""

from __future__ import annotations

import re

_PUNCT = [";", r"/", "[", "]", '"', "{", "}", "(", ")", "=", "+", "\\", "_", "-", ">", "<", "@", "`", ",", "?",
          "!"]
_COMMA_STRIP = re.compile(r"(\d)(,)(\d)")
_PERIOD_STRIP = re.compile(r"(?!<=\d)(\.)(?!\d)")
_NUMBERS = {"none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6",
            "seven": "7", "eight": "8", "nine": "9", "ten": "10"}
_ARTICLES = {"a", "an", "the"}
_CONTRACTIONS = {
    "arent": "aren't", "cant": "can't", "couldnt": "couldn't", "couldve": "could've", "didnt": "didn't",
    "doesnt": "doesn't", "dont": "don't", "hadnt": "hadn't", "hasnt": "hasn't", "havent": "haven't",
    "hed": "he'd", "hes": "he's", "howd": "how'd", "howll": "how'll", "hows": "how's", "Im": "I'm", "im": "i'm",
    "Ive": "I've", "ive": "i've", "isnt": "isn't", "itd": "it'd", "itll": "it'll", "lets": "let's",
    "mightnt": "mightn't", "mightve": "might've", "mustnt": "mustn't", "mustve": "must've", "neednt": "needn't",
    "shant": "shan't", "shed": "she'd", "shes": "she's", "shouldnt": "shouldn't", "shouldve": "should've",
    "thats": "that's", "thered": "there'd", "theres": "there's", "theyd": "they'd", "theyll": "they'll",
    "theyre": "they're", "theyve": "they've", "wasnt": "wasn't", "wed": "we'd", "weve": "we've",
    "werent": "weren't", "whatll": "what'll", "whatre": "what're", "whats": "what's", "whatve": "what've",
    "whens": "when's", "whered": "where'd", "wheres": "where's", "whereve": "where've", "whod": "who'd",
    "wholl": "who'll", "whos": "who's", "whove": "who've", "whyll": "why'll", "whyre": "why're", "whys": "why's",
    "wont": "won't", "wouldnt": "wouldn't", "wouldve": "would've", "yall": "y'all", "youd": "you'd",
    "youll": "you'll", "youre": "you're", "youve": "you've",
}


def _punctuation(text: str) -> str:
    out = text
    for p in _PUNCT:
        if (p + " " in text or " " + p in text) or _COMMA_STRIP.search(text) is not None:
            out = out.replace(p, "")
        else:
            out = out.replace(p, " ")
    return _PERIOD_STRIP.sub("", out)


def _words(text: str) -> str:
    words = []
    for w in text.lower().split():
        w = _NUMBERS.get(w, w)
        if w not in _ARTICLES:
            words.append(_CONTRACTIONS.get(w, w))
    return " ".join(words)


def vqa_normalize(answer: str) -> str:
    """The VQAv2 normal form of ``answer`` (module docstring)."""
    text = answer.replace("\n", " ").replace("\t", " ").strip()
    return _words(_punctuation(text))


def exact_match(prediction: str, reference: str) -> bool:
    return prediction.strip() == reference.strip()


def vqa_match(prediction: str, reference: str) -> bool:
    return vqa_normalize(prediction) == vqa_normalize(reference)


def accuracy(flags: list[bool]) -> float:
    """The fraction of true flags (0.0 for none)."""
    return sum(bool(f) for f in flags) / len(flags) if flags else 0.0
