"""Offline measurement of synthesised speech: phoneme error rate by a small CTC judge trained on
the corpus (``judge``), speaker similarity (``similarity``), and the evaluation driver behind
``bin/evaluate.py`` (``evaluate``). Nothing heavy is imported here."""
