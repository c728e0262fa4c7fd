"""Experiments that combine several ``unicon train`` / ``unicon evaluate`` runs into one result
(``unicon experiment <name>``). They sit above ``training`` and ``evaluation`` and import both."""
