"""Test doubles shared by several test modules."""

from searchrl.rollout.generator import Generation
from searchrl.rollout.loop import encode


class ScriptedCandidates:
    """A generator whose c-th call answers row j with ``texts[c][j % len(texts[c])]`` (the last call's texts
    repeat), tokenized as the tokenizer would: scripted candidate actions per step."""

    def __init__(self, tok, texts):
        self.tok, self.texts, self.calls = tok, texts, 0
        self.prompts = []  # the prompts of every call

    def release(self, cache_keys=None):
        pass

    def generate(self, prompts, params, cache_keys=None):
        row = self.texts[min(self.calls, len(self.texts) - 1)]
        self.prompts.append([list(p) for p in prompts])
        self.calls += 1
        out = []
        for j in range(len(prompts)):
            ids = encode(self.tok, row[j % len(row)])
            out.append(Generation(ids, [-0.5] * len(ids), "stop"))
        return out
