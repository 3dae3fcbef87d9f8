"""A user's project as the tests see one: recipes for a toy classifier, and recipes that are wrong on purpose."""
