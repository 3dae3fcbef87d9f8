"""Training recipes: the user's model, data and loss (and the built-in GPT) behind one small interface."""

from trainer.recipes.api import Pipeline, Recipe, RecipeContext

__all__ = ["Pipeline", "Recipe", "RecipeContext"]
