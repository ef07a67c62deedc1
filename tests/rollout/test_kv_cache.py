"""The continuous batch's slot cache against a plain-tensor reference: whatever sequence of decode steps,
widenings, admissions into slots, trims and packs, its keys and values are exactly the reference's."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from searchrl.rollout.kv_cache import SlotLayer, slot_cache

# compares two computation paths of the same numbers: .ci/run runs these again under a second floating-point
# path (other kernels, one thread), so a tolerance that holds on one CPU's kernels only fails in CI
pytestmark = pytest.mark.numerics

H, D = 2, 3


class Reference:
    """Rows of columns, right-aligned in a window of ``width`` columns (what the layer must expose)."""

    def __init__(self, k: torch.Tensor) -> None:
        self.k = k.clone()

    def update(self, new: torch.Tensor) -> None:
        self.k = torch.cat([self.k, new], dim=2)

    def widen(self, width: int) -> None:
        more = width - self.k.shape[2]
        if more > 0:
            self.k = torch.cat([self.k.new_zeros((self.k.shape[0], H, more, D)), self.k], dim=2)

    def place(self, slots: list[int], rows: torch.Tensor) -> None:
        top = max(slots) + 1
        if top > self.k.shape[0]:
            self.k = torch.cat([self.k, self.k.new_zeros((top - self.k.shape[0], H, self.k.shape[2], D))])
        n, width = rows.shape[2], self.k.shape[2]
        for i, s in enumerate(slots):
            self.k[s] = 0
            self.k[s, :, width - n :] = rows[i]

    def trim(self, first: int) -> None:
        self.k = self.k[:, :, first:]

    def select(self, keep: list[int]) -> None:
        self.k = self.k[keep]


ops = st.lists(
    st.tuples(st.sampled_from(["update", "widen", "place", "trim", "select"]), st.integers(0, 10**6)),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 4), n=st.integers(1, 5), max_slots=st.none() | st.integers(1, 6), program=ops)
def test_the_slot_layer_equals_the_reference(rows, n, max_slots, program):
    gen = torch.Generator().manual_seed(rows * 100 + n)
    start = torch.randn(rows, H, n, D, generator=gen)
    layer, ref = SlotLayer(start, start * 2, max_slots), Reference(start)
    peak = rows
    for op, x in program:
        R, W = ref.k.shape[0], ref.k.shape[2]
        if op == "update":
            new = torch.randn(R, H, 1 + x % 2, D, generator=gen)
            k, v = layer.update(new, new * 2)
            ref.update(new)
            assert torch.equal(k, ref.k) and torch.equal(v, ref.k * 2)
        elif op == "widen":
            layer.widen(W + x % 70)  # past the room on the left now and then
            ref.widen(W + x % 70)
        elif op == "place":
            width = ref.k.shape[2]
            count = 1 + x % 3
            slots = sorted({(x // 7 + 3 * i) % (R + 2) for i in range(count)})  # some slots past the used
            slots = [s for s in slots if s < R] + list(range(R, R + sum(s >= R for s in slots)))
            rows_ = torch.randn(len(slots), H, 1 + x % width, D, generator=gen)
            layer.place(torch.tensor(slots), rows_, rows_ * 2)
            ref.place(slots, rows_)
        elif op == "trim" and W > 1:
            layer.trim(x % W)
            ref.trim(x % W)
        elif op == "select":
            keep = sorted({(x >> i) % R for i in range(0, 12, 3)})
            layer.batch_select_indices(torch.tensor(keep))
            ref.select(keep)
        assert torch.equal(layer.keys, ref.k) and torch.equal(layer.values, ref.k * 2), op
        assert layer.get_seq_length() == ref.k.shape[2]
        peak = max(peak, ref.k.shape[0])
        if max_slots is not None:  # never more slots allocated than the batch holds, or than were used
            assert layer._k.shape[0] <= max(max_slots, peak)


def test_a_model_decodes_through_the_slot_cache_as_through_its_own():
    """A real model's decode steps through `slot_cache` give the logits its own DynamicCache gives."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from searchrl.rollout.decoding import cache_kwargs, output_cache

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    model = Qwen2ForCausalLM(cfg).eval()
    ids = torch.randint(0, 50, (3, 6))
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        ours = slot_cache(output_cache(out))
        theirs = output_cache(out)
        nxt = out.logits[:, -1].argmax(-1)
        for step in range(6, 40):  # past the room the slot buffers start with
            mask = torch.ones(3, step + 1, dtype=torch.long)
            a = model(
                input_ids=nxt[:, None], attention_mask=mask, use_cache=True, **cache_kwargs(model, ours)
            )
            b = model(
                input_ids=nxt[:, None], attention_mask=mask, use_cache=True, **cache_kwargs(model, theirs)
            )
            torch.testing.assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-6)
            nxt = b.logits[:, -1].argmax(-1)
