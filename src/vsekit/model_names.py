"""The built-in models' names, readable without torch, so ``vsekit train --model`` refuses a misspelt
one with a "did you mean" before torch or any model is imported. The registries (``vsekit.models``,
``vsekit.extract.backbones``) hold exactly these names: ``tests/test_one_message.py`` checks it."""

#: ``vsekit train --model``: the retrieval models of ``vsekit.models``
RETRIEVAL_MODELS = ("order", "saf", "seam-c", "seam-e", "seam-g", "sgr", "sman", "sman-im", "sman-im-loc",
                    "sman-inter", "sman-sim", "vse")

#: ``vsekit extract --model``: the registered backbones (any timm model name is taken too)
BACKBONES = ("inception_resnet_v2", "resnet152", "vgg16", "vgg19")
