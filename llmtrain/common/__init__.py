"""Leaves every part may import, and which import nothing of llmtrain (nor each other): the
errors llmtrain reports to its user (:mod:`.errors`), where its files live (:mod:`.paths`), the
label of tokens without loss (:mod:`.labels`), and torch files loaded without unpickling code
(:mod:`.safe_load`)."""
