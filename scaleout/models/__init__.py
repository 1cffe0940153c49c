"""Models: BERT for pre-training (:mod:`scaleout.models.bert`), ResNet (:mod:`scaleout.models.resnet`)."""
