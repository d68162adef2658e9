"""The measuring command `ftchat bench` (speed): bench.py runs the arms, bench_ui.py loads the
model and prints the figures, arms_help.py turns --prefetch / --budget into arms and prints the
--help-arms page; load.py loads a model with its VRAM plan checked first (bench,
and the debug commands `verify` and `audit` in ftchat/debug). user_files.py: the prompt file
and synth folder a user names (cli.py)."""
