"""EditingScore (the BagelScore/EditingScore paper, section 3 and Table 4): how well a model-internal
score of an edit, ``cos(f(x_s), f(x_t)) * sim_text(p, f^(x_t)) / (rls(x_s, x_t)^2 + eps)``, ranks edits
as raters do. The modules are the rooms of every suite (docs/layout.md).
"""
