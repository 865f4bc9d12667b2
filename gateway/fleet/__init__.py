"""The fleet as the gateway sees it: workers grouped into one pool per base (`pools`), each
base's tokenizer, chat template and limits loaded when it first appears (`bases`), and the
LoRA-affinity score that places a request inside its pool (`affinity`)."""
