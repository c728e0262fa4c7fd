"""RealUnify (Shi et al.): does unification help? Understanding Enhances Generation (UEG) and
Generation Enhances Understanding (GEU), each direct and stepwise. The modules are the rooms of every
suite (docs/layout.md).
"""
