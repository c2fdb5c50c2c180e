"""What the speculative-decoding tests share: the demo pair, the proposers' configs, prompts that
repeat (so prompt lookup finds drafts), and an engine that drafts at every step."""
import os

from ridge import LLM, SamplingParams
from ridge.assets import demo_model_path
from tests.tests_support import prompt_of

DEMO = demo_model_path()
DRAFT = os.path.join(os.path.dirname(DEMO), "demo-code-3m")
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 8}
EAGLE3 = {"method": "eagle3", "model": "demo-code-12m-eagle3", "num_speculative_tokens": 4}   # the demo model's head
MTP = {"method": "mtp", "num_speculative_tokens": 3}       # the target's own multi-token-prediction layer
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def draft_model(path, k=3):
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k}


def config_of(proposer: str, draft: str) -> dict:
    return {"ngram": NGRAM, "suffix": SUFFIX, "eagle3": EAGLE3, "mtp": MTP}.get(proposer) or draft_model(draft)


def repetitive(salt: int, n: int = 40) -> list[int]:
    """Prompts that repeat a phrase, so prompt lookup finds matches."""
    return (prompt_of(7, salt) * 8)[:n]


PROMPTS = [repetitive(i) for i in range(3)] + [prompt_of(21, 5), prompt_of(3, 6)]


def llm(model, **kw):
    """An engine; with speculation, drafts run at their model cost (always_draft) and, unless the
    config sets disable_by_batch_size, no batch size turns them off: whether they pay on this
    machine (in time, or by the batch cutoff from its measured ceilings) is the clock's and
    memory_bound_batch's own test, the rest of this file checks what they do."""
    engine_llm = LLM(model, device="cpu", show_progress=False, max_model_len=256, **kw)
    if engine_llm.engine.speculator is not None:
        always_draft(engine_llm)
        if "disable_by_batch_size" not in (kw.get("speculative_config") or {}):
            engine_llm.engine.speculator.cutoff = engine_llm.engine.cfg.max_num_seqs
    return engine_llm


def always_draft(engine_llm):
    """Drafts at every step and batch size, k set by acceptance at the model's OVERHEAD (not by
    what verify steps measure on this machine)."""
    clock = engine_llm.engine.speculator.clock
    clock.pays, clock.overhead = (lambda batch: True), (lambda batch, draft_cost=0.0: None)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]
