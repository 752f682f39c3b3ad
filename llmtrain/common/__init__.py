"""Leaves every part may import, and which import nothing of llmtrain (nor each other): the
errors llmtrain reports to its user (:mod:`.errors`), where its files live (:mod:`.paths`), the
label of tokens without loss (:mod:`.labels`), torch files loaded without unpickling code
(:mod:`.safe_load`), Ctrl-C in a command's start-up as one line (:mod:`.interrupt`), and the image
inputs and processor of a vision-language run (:mod:`.images`)."""
