"""The resilience core: the step protocol, its gradient sync, the control channel,
fault injection, quarantine, memory and the pessimistic scan.

The training loop talks to it through `ResilientStep` (run / flush / guarded
work / validation / consistency) and nothing else; see docs/oom.md.
"""
