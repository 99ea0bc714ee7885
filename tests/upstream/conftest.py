"""tests/upstream/ holds by-hand drivers for real upstream checkouts (see megatron_pretrain.py); pytest
collects nothing here, so ``make test`` never runs them."""

collect_ignore_glob = ["*.py"]
