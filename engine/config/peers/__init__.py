"""Other trainers' config keys read with their meaning: SimpleTuner's (``simpletuner.py``) and the
recipe keys of SimpleTuner and diffusers' training scripts with SimpleTuner's defaults (``recipe.py``)."""
