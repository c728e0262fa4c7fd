"""The embedded world's task accuracies (``unicon evaluate shapes``), in the rooms every suite has:

``runner``  the model's generation methods over a ShapesWorld split, checked by the world's exact
            verifiers (VQA exact match, caption scene match, localization IoU, T2I scene match);
``plots``   the picture grid of examples;
``cli``     ``unicon evaluate shapes``.
"""
