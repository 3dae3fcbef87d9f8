"""Training recipes: the user's model, data and loss (and the built-in GPT) behind one small interface."""

from trainer.recipes.api import ContextParallel, Pipeline, Recipe, RecipeContext, positions

__all__ = ["ContextParallel", "Pipeline", "Recipe", "RecipeContext", "positions"]
