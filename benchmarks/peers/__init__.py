"""Peer drafters behind the interface ``sssd.calibration.replay.replay`` drives.

One module per peer; each documents what it reproduces, from which source,
and where it differs:

==================  ==========================================================
``pld``             prompt lookup decoding, as HF transformers does it (chain)
``ngram_vllm``      vLLM's n-gram proposer (chain)
``rest``            REST's suffix-array retrieval, re-implemented on SSSD's
                    datastore (tree), plus a budget-filling variant
``aded``            ADED's retriever: PyPI ``draftretriever==0.1.1`` (tree)
``suffix_decoding`` SuffixDecoding: PyPI ``arctic-inference`` (tree)
==================  ==========================================================

ADED and SuffixDecoding need their packages (``benchmarks/peers/setup_arctic.sh``
installs both into ``.venv-peers``); the others need only numpy and sssd.
"""
