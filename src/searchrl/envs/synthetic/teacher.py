"""A scripted teacher that solves questions with their decompositions, through the real `SearchEnv`.

It writes think / search / answer actions in either tag style; the environment supplies the retrieved
documents. In clean mode it searches each hop's gold keys until the gold document comes back, and only
then states the sub-answer it read. In noisy mode it also makes the mistakes RL should remove, at
configurable rates: repeating an earlier search, answering after too few hops, and issuing a vague query.
With ``plan`` every thought also states how many searches are still needed ("Steps left: 1."), so an
answer given too early says so itself.
Trajectories feed the SFT warm start; with ``rename_prob`` > 0 every entity name in a trajectory is
consistently replaced by a fresh name from the world's pool, so a model must learn to copy names from what
it retrieved rather than memorise the training facts.
"""

from __future__ import annotations

import random
import re
from typing import Any

from searchrl.core.config import TeacherConfig
from searchrl.core.errors import DataError
from searchrl.core.records import Example
from searchrl.core.types import EnvState
from searchrl.envs.search import SearchEnv
from searchrl.envs.synthetic.world import World
from searchrl.envs.tags import REFINE_CLOSE, REFINE_OPEN

_NAME = re.compile(r"\b[A-Z][a-z]+(?: University)?\b")


def vague_query(question: str) -> str:
    """The sub-question without its entity names: 'Who directed Keve?' -> 'who directed'."""
    words = _NAME.sub(" ", question.rstrip("?"))
    return " ".join(words.split()).lower() or "information"


class TeacherEpisode:
    """State machine for one question. ``next_action`` reads the environment state after each step."""

    def __init__(self, example: Example, env: SearchEnv, config: TeacherConfig, rng: random.Random) -> None:
        if not example.hops:
            raise DataError(f"the teacher needs a decomposition; example {example.id} has no hops")
        self.ex, self.env, self.cfg, self.rng = example, env, config, rng
        self.hop = 0  # index of the hop being solved
        self.key = 0  # index of the next gold key to try for that hop
        self.found: list[str] = []
        self.pending: str | None = None  # the query whose result we are waiting for
        self.vague_done = False
        self.early_done = False
        self.repeat_query: str | None = None
        self.just_found = False
        self.refined = ""  # what the last search's documents established (the refine block)

    @property
    def best_answer(self) -> str:
        return self.found[-1] if self.found else "unknown"

    def _answer(self, ans: str, note: str = "") -> str:
        return self.env.write_answer(ans, f"{note} " if (self.cfg.quote or self.cfg.plan) and note else "")

    def _search(self, think: str, query: str) -> str:
        self.pending = query
        return self.env.write_search(think, query)

    def _read_result(self, state: EnvState) -> str:
        """Update what the teacher knows from its last search; returns a note for the next thought."""
        if self.pending is None or not state.infos:
            return ""
        hops, last = self.ex.hops, state.infos[-1]
        self.pending = None
        self.refined = "Nothing new."
        if self.repeat_query is not None:
            self.repeat_query = None  # that was a redundant repeat: nothing new
            return "Nothing new."
        hop = hops[self.hop]
        # the sub-answer must be readable in what came back (a document cut short does not count)
        if hop.gold_doc_id not in last.doc_ids or hop.answer not in state.observations[-1]:
            self.refined = "The documents do not say."
            return "Not found."
        self.found.append(hop.answer)
        self.hop, self.key, self.vague_done = self.hop + 1, 0, False
        self.just_found = True
        self.refined = f"{_sentence_with(state.observations[-1], hop.answer)}."
        if self.cfg.quote:
            return f"Found: {_sentence_with(state.observations[-1], hop.answer)}."
        return f"Found: {hop.answer}."

    def next_action(self, state: EnvState) -> str:
        searched = self.pending is not None and bool(state.infos)
        action = self._next_action(state)
        if (
            self.cfg.refine and searched and not state.force_answer
        ):  # AutoRefine: what the documents said first
            return f"{REFINE_OPEN} {self.refined} {REFINE_CLOSE}\n{action}"
        return action

    def _next_action(self, state: EnvState) -> str:
        cfg, hops = self.cfg, self.ex.hops
        query, self.just_found = self.pending, False
        note = self._read_result(state)
        if state.force_answer:  # the turn budget ran out: the environment already wrote <answer>
            return self.env.write_forced_answer(self.best_answer)
        if cfg.plan:  # what is left to find, so that searching on or answering reads from this thought
            note = f"{note} Steps left: {len(hops) - self.hop}.".strip()
        if self.just_found and query is not None and cfg.noisy and self.rng.random() < cfg.p_repeat:
            self.repeat_query = query
            return self._search(f"{note} Let me check again.", query)
        if self.hop == len(hops):
            return self._answer(self.best_answer, note)
        if cfg.noisy and not self.early_done and self.found and self.rng.random() < cfg.p_early:
            self.early_done = True
            return self._answer(self.best_answer, note)
        hop = hops[self.hop]
        think = f"{note} Next: {hop.question}".strip()
        if cfg.noisy and not self.vague_done and self.rng.random() < cfg.p_vague:
            self.vague_done = True
            return self._search(think, vague_query(hop.question))
        if self.key >= len(hop.keys):  # every gold key failed: give up honestly
            return self._answer(self.best_answer)
        self.key += 1
        return self._search(think, hop.keys[self.key - 1])


def _sentence_with(observation: str, name: str) -> str:
    """The first sentence of a retrieved document that names ``name`` (the document's text, without the
    environment's wrapping), without its full stop."""
    text = re.sub(r"^.*?\(Title: [^)]*\)\s*", "", observation.strip(), flags=re.S)
    text = re.sub(r"</?\w+>|<\|\w+\|>", "", text)  # tags, and chat markers (the tool protocol)
    for sentence in re.split(r"(?<=\.)\s+", text):
        if re.search(rf"\b{re.escape(name)}\b", sentence):
            return sentence.strip().rstrip(".")
    return name


def run_teacher(
    env: SearchEnv, examples: list[Example], config: TeacherConfig | None = None, max_steps: int = 32
) -> list[EnvState]:
    """Run the teacher on every example, batching the environment's retrieval across episodes."""
    config = config or TeacherConfig()
    rng = random.Random(config.seed)
    states = [env.reset(ex) for ex in examples]
    episodes = [TeacherEpisode(ex, env, config, random.Random(rng.random())) for ex in examples]
    for _ in range(max_steps):
        active = [i for i, s in enumerate(states) if not s.done]
        if not active:
            break
        actions = [episodes[i].next_action(states[i]) for i in active]
        env.step_batch([states[i] for i in active], actions)
    return states


def trajectory_record(
    state: EnvState, world: World | None = None, rename: bool = False, rng: random.Random | None = None
) -> dict[str, Any]:
    """A JSON-able SFT record of a finished episode, optionally with every entity consistently renamed."""
    ex = state.example
    texts: dict[str, Any] = {
        "question": ex.question,
        "prompt": state.prompt,
        "actions": list(state.actions),
        "observations": list(state.observations),
        "answers": list(ex.answers),
    }
    mapping: dict[str, str] = {}
    if rename:
        if world is None or rng is None:
            raise ValueError("renaming needs the world (for its name pool) and an rng")
        flat = [texts["prompt"], *texts["actions"], *texts["observations"], *texts["answers"]]
        mapping = world.rename_map(rng, flat)

        def rn(x: Any) -> Any:
            return (
                [world.apply_renaming(s, mapping) for s in x]
                if isinstance(x, list)
                else world.apply_renaming(x, mapping)
            )

        texts = {k: rn(v) for k, v in texts.items()}
    return {
        "id": ex.id,
        **texts,
        "renamed": bool(mapping),
        "finish_reason": state.finish_reason,
        "n_searches": state.n_searches,
        "answer": world.apply_renaming(state.answer, mapping)
        if (world and mapping and state.answer)
        else state.answer,
    }


def teacher_records(
    env: SearchEnv, world: World, examples: list[Example], config: TeacherConfig
) -> list[dict[str, Any]]:
    states = run_teacher(env, examples, config)
    rng = random.Random(config.seed + 7)
    recs = [trajectory_record(s, world, rename=rng.random() < config.rename_prob, rng=rng) for s in states]
    return recs if env.append_only else [r for rec in recs for r in step_records(env, rec)]


def step_records(env: SearchEnv, rec: dict[str, Any]) -> list[dict[str, Any]]:
    """An episode record as one record per step for a re-rendered agent design (RAG-Gym ReSearch): the
    state before each action, rendered by ``env`` from the record's own (possibly renamed) texts, as the
    prompt, and that action alone. Nothing is retrieved again."""
    ex = Example(id=rec["id"], question=rec["question"], answers=tuple(rec["answers"]))
    out = []
    for i, action in enumerate(rec["actions"]):
        state = env.replay(ex, rec["actions"][:i], rec["observations"][:i])
        out.append({**rec, "prompt": env.render(state), "actions": [action], "observations": [""], "step": i})
    return out
