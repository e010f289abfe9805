"""Speculative decoding: draft proposers and the verification of drafts against the target model.

    ngram.py      prompt lookup: the tokens that followed the latest earlier match of the suffix
    rejection.py  greedy and exact speculative-sampling acceptance over the target's k+1 rows

The worker drives both (`worker/drafters.py`); the engine only schedules drafts and counts them.
"""
