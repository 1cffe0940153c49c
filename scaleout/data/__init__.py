"""Data: sequence packing (:mod:`scaleout.data.packing`), BERT batches (:mod:`scaleout.data.bert_batch`),
image data and samplers. Submodules are imported explicitly so that importing one does not pull in torch."""
