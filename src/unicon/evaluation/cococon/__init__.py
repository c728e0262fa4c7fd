"""CocoCon cross-task consistency evaluation (Maharana et al., sections 3 and 4.3). The modules are the
rooms of every suite (docs/layout.md); the samples come from :func:`unicon.data.cococon.load_cococon`.
"""
