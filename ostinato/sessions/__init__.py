"""Agent sessions: recorded ones read from their formats (tau2, tau-bench, SWE-agent, our JSONL) or
generated from the recordings' statistics, as turns of messages, and their text. The bench
replays them, the planner profiles them, synth trains its tokenizer on them."""
