"""Speculative decoding itself: positions and sequences, the generation's prefill and step
(draft, verify, accept, roll back), verification rules, sampling, draft trees, the draft
length planner and the statistics. Talks to the bindings and the drafters, never to a server."""
