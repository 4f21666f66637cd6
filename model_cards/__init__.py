"""Model card templates, shipped as package data (``importlib.resources.files("s2_models.model_cards")``)."""
