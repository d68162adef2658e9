"""Debug: the watchers that check the offload backend (verifier, slot audit, routing recorder)
and the commands that run them (`ftchat verify`, `ftchat audit`).

watchers.py        the watchers the settings turn on, chained (`hooks_for`, `HookChain`)
verifier.py        --verify: slot maps, in-flight copies and bytes checked at every kernel
slot_audit.py      --audit-every: the whole slot cache byte-checked every N steps
routing_record.py  --record-routing: routed ids and lookahead candidates, one JSON line a step
record_buffer.py   the device-side buffer the verifier appends its findings to
verify_command.py  `ftchat verify`: prefetch on vs off over cold prompts
audit_command.py   `ftchat audit`: a decode run with the slot audit on

The engine never imports this package: whoever builds a backend passes the watchers in.
"""
