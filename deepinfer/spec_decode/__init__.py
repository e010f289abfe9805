"""Speculative decoding: every drafter and the verification of drafts against the target model.

    drafter.py       draft_budget; NgramDrafter: prompt lookup (no model)
    ngram.py         the prompt-lookup proposer: the tokens that followed the latest earlier match
    chain.py         the one chain loop of the model drafters (pass 0, then one-token passes)
    mtp.py           MtpDrafter: DeepSeek's next-n module over its "mtp" ring
    draft_model.py   DraftModelDrafter: a smaller checkpoint over its own rows at the target's units
    draft_source.py  the draft checkpoint: opened, its tokenizer checked, built
    rejection.py     greedy and exact speculative-sampling acceptance over the target's k+1 rows

Every drafter is a `Drafter` (contracts/drafting.py). This package sits between the worker and the
model executor: it imports neither the worker nor the engine; the worker builds the drafter of the
configured method and hands it what its passes need (`worker/drafting.py`), and the engine only
schedules drafts and counts them.
"""
