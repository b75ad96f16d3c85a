"""Series colours shared by the console's charts and timeline."""

# Okabe-Ito: distinguishable with the common colour-vision deficiencies
PALETTE = ("#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7", "#999999")
