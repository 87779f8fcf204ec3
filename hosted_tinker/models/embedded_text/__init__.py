"""Text the embedded tiny model is built from: its chat templates and its BPE training corpus."""
