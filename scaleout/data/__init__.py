"""Data: sequence packing (:mod:`scaleout.families.bert.packing`), BERT batches (:mod:`scaleout.families.bert.data.bert_batch`),
image data and samplers. Submodules are imported explicitly so that importing one does not pull in torch."""
