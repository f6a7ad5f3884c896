"""Token reduction inside vision-language models (issue 36); the public names come with vitrim.vlm.api."""
