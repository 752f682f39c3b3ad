"""Configuration: the typed schema (:mod:`.schema`), Hydra composition and the command line's
checks (:mod:`.compose`), which keys the schema has (:mod:`.keys`), the cross-field validation of
every section (:mod:`.validate`) and the layout derived from it once (:mod:`.layout`).

Pure: nothing here touches devices, files other than the shipped configs, or other parts of
llmtrain; checks against the machine are :mod:`llmtrain.planning.preflight`'s. Imports only
:mod:`llmtrain.common`. Inside, the schema sits at the bottom (it imports nothing of llmtrain
but ``common``), composition and validation on top."""
