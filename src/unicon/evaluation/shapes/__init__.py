"""The embedded world's task accuracies (``unicon evaluate shapes``), in the rooms every suite has:

``metrics``   the accuracies as torchmetrics metrics with summed states (VQA exact match, caption
              scene match, localization IoU, T2I scene match, relation flips), by slice and by
              cause of a miss;
``runner``    the model's generation methods over a ShapesWorld split, sharded across ranks, scored
              by those metrics;
``callback``  :class:`~.callback.ShapesCallback`, the same at the end of training epochs
              (``eval.shapes``);
``plots``     the picture grid of examples;
``cli``       ``unicon evaluate shapes``.
"""
