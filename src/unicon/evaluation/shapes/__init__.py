"""The embedded world's task accuracies (``unicon evaluate shapes``), in the rooms every suite has:

``metrics``   the accuracies as torchmetrics metrics with summed states (VQA exact match, caption
              scene match, localization IoU, T2I scene match, relation flips), by slice and by
              cause of a miss;
``runner``    the model's generation methods over a ShapesWorld split, sharded across ranks, scored
              by those metrics;
``plots``     the picture grid of examples;
``suite``     ``unicon evaluate shapes`` and ``eval.shapes`` at the end of training epochs.
"""
